"""inspect_projections: how a head's W_Q, W_K, W_V (and W_O) differ, and what attention would be without them.

``models`` holds the arguments and report, ``plan`` the pass (a :class:`PassPlan` the ``analyze`` job can
share) and the measures, ``narrative`` the findings and summary. The weights come from
:mod:`agent_tools.layout`; the pass and its parity check are shared with reconstruct_attention
(:mod:`agent_tools.consumers.head_inputs`, :mod:`agent_tools.head_inputs_pass`).
"""

from __future__ import annotations

from agent_tools.tools.inspect_projections.models import (
    DESCRIPTION,
    InspectProjectionsInput,
    ProjectionReport,
)
from agent_tools.tools.inspect_projections.narrative import next_calls
from agent_tools.tools.inspect_projections.plan import plan_inspect_projections
from agent_tools.tools.registry import ToolSpec, Top

__all__ = [
    "SPEC",
    "InspectProjectionsInput",
    "ProjectionReport",
    "plan_inspect_projections",
]

SPEC = ToolSpec(
    name="inspect_projections",
    description=DESCRIPTION,
    input_model=InspectProjectionsInput,
    output_model=ProjectionReport,
    run=None,
    plan=plan_inspect_projections,
    example={"text": "The cat sat on the mat because it was tired.", "layer": 3, "head": 0},
    summary_lists=(
        Top("tokens", 32, order="first"),
        Top("counterfactual.rows", 24, by="js_divergence"),
    ),
    next_calls=next_calls,
    advanced=("png",),
)
