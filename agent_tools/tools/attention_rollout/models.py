"""attention_rollout's arguments and report models."""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent_tools.schemas import Report, TextInput

DESCRIPTION = (
    "Attention rollout (Abnar & Zuidema 2020) for one target token: the head-averaged attention of every layer, "
    "mixed with the identity for the residual stream and multiplied through the layers, gives each source "
    "token's share of the target (shares sum to 1), next to the target's raw last-layer attention."
)


class AttentionRolloutInput(TextInput):
    position: int | None = Field(
        default=None,
        description="target token position (0-based; negative counts from the end, -1 = last); omitted = the last "
        "token for causal models, the first ([CLS]) for encoders",
    )
    up_to_layer: int | None = Field(
        default=None, description="roll out through layers 0..up_to_layer only; omitted = every layer"
    )
    residual: float = Field(
        default=0.5,
        ge=0.0,
        lt=1.0,
        description="weight r of the identity (residual stream) in each layer's Â = r·I + (1 − r)·Ā; 0.5 in the paper",
    )
    top_k: int = Field(default=5, ge=1, le=50, description="source tokens named in the summary and findings")


class SourceShare(BaseModel):
    position: int
    token: str
    share: float = Field(description="rollout: share of the target's representation that flows from this token")
    last_layer_attention: float = Field(description="the target's head-averaged attention to it in the last layer used")


class RolloutReport(Report):
    position: int
    token: str
    layers: int = Field(description="layers rolled out (0..layers-1)")
    residual: float
    sources: list[SourceShare] = Field(description="every source token, in position order; shares sum to 1")
    top_sources: list[SourceShare]
    total: float = Field(description="sum of the shares (1 up to rounding)")
