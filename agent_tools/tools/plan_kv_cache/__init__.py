"""plan_kv_cache: which KV heads could be served from a sink + window cache (DuoAttention's streaming heads)?

``models`` holds the arguments and report, ``plan`` the masked passes (every KV head restricted on its own, one pass
per layer group; then the plan built in verified groups, one single-row run each), ``narrative`` the summary and
findings.
"""

from __future__ import annotations

from agent_tools.tools.plan_kv_cache.models import (
    DESCRIPTION,
    PlanKvCacheInput,
    PlanKvCacheReport,
)
from agent_tools.tools.plan_kv_cache.plan import plan_kv_cache
from agent_tools.tools.registry import ToolSpec, Top

__all__ = [
    "SPEC",
    "PlanKvCacheInput",
    "PlanKvCacheReport",
    "plan_kv_cache",
]

EXAMPLE_TEXT = (
    "The baker argued with the miller about the price of flour. Up on the hill the old keeper wrote the weather "
    "into his logbook. Then the baker argued with the miller about the price of flour again."
)

SPEC = ToolSpec(
    name="plan_kv_cache",
    description=DESCRIPTION,
    input_model=PlanKvCacheInput,
    output_model=PlanKvCacheReport,
    run=plan_kv_cache,
    example={
        "text": EXAMPLE_TEXT,
        "sink": 4,
        "window": 8,
        "loss_budget": 0.05,
        "context_length": 8192,
        "layers": [24, 25, 26, 27, 28, 29],
    },
    summary_lists=(Top("heads", 12, by="loss_change"),),
)
