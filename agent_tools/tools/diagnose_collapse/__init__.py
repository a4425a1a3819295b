"""diagnose_collapse: which heads collapse, onto which token, and is it a harmless sink?

``models`` holds the arguments and report, ``plan`` the pass (shared with other tools in ``analyze``) and
``narrative`` the summary and findings text.
"""

from __future__ import annotations

from agent_tools.tools.diagnose_collapse.models import (
    DESCRIPTION,
    CollapseReport,
    DiagnoseCollapseInput,
)
from agent_tools.tools.diagnose_collapse.narrative import next_calls
from agent_tools.tools.diagnose_collapse.plan import plan_diagnose_collapse
from agent_tools.tools.registry import ToolSpec, Top

__all__ = [
    "SPEC",
    "CollapseReport",
    "DiagnoseCollapseInput",
    "plan_diagnose_collapse",
]

SPEC = ToolSpec(
    name="diagnose_collapse",
    description=DESCRIPTION,
    input_model=DiagnoseCollapseInput,
    output_model=CollapseReport,
    run=None,
    plan=plan_diagnose_collapse,
    example={"text": "The cat sat on the mat because it was tired.", "top_k": 5},
    summary_lists=(Top("heads", 10, order="first", label="collapse"),),  # already most collapsed first
    next_calls=next_calls,
    advanced=("threshold", "heads", "png", "max_checked", "baseline_draws", "seed"),
)
