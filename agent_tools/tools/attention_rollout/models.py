"""attention_rollout's arguments and report models."""

from __future__ import annotations

from pydantic import Field

from agent_tools.schemas import Report, Rounded6, TextInput, TokenRow
from agent_tools.stack_input import StackInput, StackReport

DESCRIPTION = (
    "Attention rollout: how much of one token flows from each source token through all layers, beside raw "
    "attention. Use for token attribution; mind sinks."
)


class AttentionRolloutInput(TextInput, StackInput):
    position: int | None = Field(
        default=None,
        description="the token explained (-1 = last); omitted = last, or first on encoders",
    )
    up_to_layer: int | None = Field(default=None, description="omitted = the last")
    residual: float = Field(
        default=0.5,
        ge=0.0,
        lt=1.0,
        description="weight r of the identity (residual stream) in each layer's Â = r·I + (1 − r)·Ā; 0.5 in the paper",
    )
    top_k: int = Field(default=5, ge=1, le=50, description="source tokens named in the summary and findings")


class SourceShare(TokenRow):
    share: Rounded6 = Field(description="rollout: share of the target's representation that flows from this token")
    last_layer_attention: Rounded6 = Field(
        description="the target's head-averaged attention to it in the last layer used"
    )


class RolloutReport(Report, StackReport):
    position: int
    token: str
    layers: int = Field(description="layers rolled out (0..layers-1)")
    residual: float
    sources: list[SourceShare] = Field(description="every source token, in position order; shares sum to 1")
    top_sources: list[SourceShare]
    total: Rounded6 = Field(description="sum of the shares (1 up to rounding)")
