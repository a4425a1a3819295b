"""explain_scaling: what does 1/sqrt(d_k) do in this model, on this text?

``models`` holds the arguments and report, ``plan`` the pass (shared with other tools in ``analyze``) and
``narrative`` the summary and findings text.
"""

from __future__ import annotations

from agent_tools.tools.explain_scaling.models import (
    DESCRIPTION,
    ExplainScalingInput,
    ScalingReport,
)
from agent_tools.tools.explain_scaling.narrative import next_calls
from agent_tools.tools.explain_scaling.plan import plan_explain_scaling
from agent_tools.tools.registry import ToolSpec, Top

__all__ = [
    "SPEC",
    "ExplainScalingInput",
    "ScalingReport",
    "plan_explain_scaling",
]

SPEC = ToolSpec(
    name="explain_scaling",
    description=DESCRIPTION,
    input_model=ExplainScalingInput,
    output_model=ScalingReport,
    run=None,
    plan=plan_explain_scaling,
    example={"text": "The cat sat on the mat because it was tired.", "layer": 3},
    summary_lists=(Top("head_variances", 12, by="raw_variance"),),
    next_calls=next_calls,
    advanced=("temperatures", "synthetic"),
)
