"""profile_heads: what does each head do? Role scores for every head, a primary role, and the evidence.

Streaming forward passes, whatever the number of heads: the text and the held-out texts (text roles and named
patterns), and probes of random tokens repeated twice (induction, duplicate-token; :mod:`agent_tools.probes`).
Each layer's maps are reduced to a few sums per head as they stream past
(:class:`~agent_tools.consumers.roles.RoleScoreConsumer`) and dropped. The roles are the registry
:data:`agent_tools.analysis.heads.ROLES`; the top heads of a role with an ablation check are mean-ablated, each
alone, against random heads, in one batched forward. :func:`detect_pattern` scores a Python user's own pattern.

``models`` holds the arguments and report, ``plan`` the passes (the text pass is a :class:`PassPlan` the
``analyze`` job shares), ``narrative`` the summary and findings.
"""

from __future__ import annotations

from agent_tools.tools.profile_heads.models import (
    DESCRIPTION,
    SAMPLE_TEXT,
    HeadProfiles,
    ProfileHeadsInput,
)
from agent_tools.tools.profile_heads.plan import detect_pattern, plan_profile_heads, profile_heads
from agent_tools.tools.registry import ToolSpec, Top

__all__ = [
    "SAMPLE_TEXT",
    "SPEC",
    "HeadProfiles",
    "ProfileHeadsInput",
    "detect_pattern",
    "plan_profile_heads",
    "profile_heads",
]

SPEC = ToolSpec(
    name="profile_heads",
    description=DESCRIPTION,
    input_model=ProfileHeadsInput,
    output_model=HeadProfiles,
    run=profile_heads,
    plan=plan_profile_heads,
    example={"text": "The cat sat on the mat because it was tired.", "layers": [0, 1, 2]},
    summary_lists=(Top("heads", 12, by="confidence"),),
    advanced=(
        "seed",
        "seeds",
        "probe_length",
        "thresholds",
        "skip_queries",
        "local_window",
        "induction_check",
        "top_k",
        "ablate_top",
        "baseline_draws",
        "held_out_texts",
    ),
)
