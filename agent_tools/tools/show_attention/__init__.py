"""show_attention: what does layer L / head H attend to on this text?

``models`` holds the arguments and report, ``plan`` the pass (one head's map, kept by
:class:`~agent_tools.consumers.head_map.HeadMapConsumer`) and the numbers, ``narrative`` the finding and summary.
"""

from __future__ import annotations

from agent_tools.tools.registry import ToolSpec, Top
from agent_tools.tools.show_attention.models import DESCRIPTION, AttentionView, ShowAttentionInput
from agent_tools.tools.show_attention.narrative import next_calls
from agent_tools.tools.show_attention.plan import held_bytes, show_attention

__all__ = ["SPEC", "AttentionView", "ShowAttentionInput", "held_bytes", "show_attention"]

SPEC = ToolSpec(
    name="show_attention",
    description=DESCRIPTION,
    input_model=ShowAttentionInput,
    output_model=AttentionView,
    run=show_attention,
    example={"text": "The cat sat on the mat because it was tired.", "layer": 3, "head": 0},
    summary_lists=(
        Top("rows", 24, by="position", label="position (the last queries first)"),
        Top("tokens", 32, order="first"),
    ),
    next_calls=next_calls,
    advanced=("top_k", "include_map", "png"),
)
