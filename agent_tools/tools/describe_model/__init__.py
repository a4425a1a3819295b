"""describe_model: what is this model's attention? Family, layers, heads, KV heads, head_dim, scale, mask.

``models`` holds the arguments and report, ``plan`` reads the facts (no forward pass), ``narrative`` writes
the mask, findings and summary.
"""

from __future__ import annotations

from agent_tools.tools.describe_model.models import DESCRIPTION, DescribeModelInput, ModelDescription
from agent_tools.tools.describe_model.narrative import next_calls
from agent_tools.tools.describe_model.plan import describe_model
from agent_tools.tools.registry import ToolSpec

__all__ = ["SPEC", "DescribeModelInput", "ModelDescription", "describe_model"]

SPEC = ToolSpec(
    name="describe_model",
    description=DESCRIPTION,
    input_model=DescribeModelInput,
    output_model=ModelDescription,
    run=describe_model,
    example={},
    next_calls=next_calls,
)
