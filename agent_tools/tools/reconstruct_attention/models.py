"""reconstruct_attention's arguments and report: the pydantic models an agent reads, with their descriptions."""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent_tools.analysis.reconstruct import ReconstructionStage
from agent_tools.schemas import Report, TextInput, Token

PARITY_TOLERANCE = 1e-5  # stage 5 must equal the model's weights to this (the contract)

DESCRIPTION = (
    "Rebuild one head's attention step by step from the layer's own input and measure each step: (1) raw "
    "dot products x·xᵀ, (2) divided by sqrt(d_k) (d_k = the head's dimension), (3) projected with W_Q and W_K, "
    "(4) with positions (RoPE), (5) with the causal/padding/sliding-window mask and soft-capping, then softmax "
    "— which equals the "
    "model's own map (the error is reported). Per stage: entropy, max weight, self-share, top key per query, "
    "divergence from the model's map; optional PNG per stage. Shows which ingredient makes the head attend "
    "the way it does."
)


class ReconstructAttentionInput(TextInput):
    layer: int = Field(description="layer index, 0-based (describe_model gives the range)")
    head: int = Field(description="query head index, 0-based")
    mask_every_stage: bool = Field(
        default=False,
        description="apply the mask to stages 1–4 too (on causal models this isolates the other pieces); "
        "by default the mask enters only at stage 5, as in the recipe",
    )
    png: bool = Field(default=False, description="write each stage's map as a PNG heatmap into the artifact folder")


class QueryTopKey(BaseModel):
    position: int = Field(description="query position")
    token: str
    key_position: int = Field(description="the key this query weights most at this stage")
    key_token: str
    weight: float


class StageReport(BaseModel):
    stage: int = Field(description="1..5")
    name: ReconstructionStage
    added: str = Field(description="what this stage adds to the previous one")
    scale: float = Field(description="factor the dot products are multiplied by at this stage")
    divisor: float = Field(
        description="what the dot products are divided by at this stage (1 / scale): 1 at stage 1, sqrt(d_k) at "
        "stage 2, the model's own 1/scale (sqrt(d_k) for the standard scale) at stages 3–5"
    )
    masked: bool = Field(description="whether the model's mask is applied at this stage")
    mean_entropy: float = Field(description="mean entropy of the softmax rows, nats")
    mean_normalised_entropy: float = Field(description="mean entropy / log(keys visible): 0 one key, 1 uniform")
    mean_max_weight: float
    self_share: float = Field(description="mean weight a query puts on itself")
    logit_std: float = Field(description="mean over queries of the standard deviation of its logits")
    mean_js_to_model: float = Field(description="mean per-query Jensen–Shannon divergence to the model's map, nats")
    masked_js_to_model: float = Field(
        description="the same after applying the model's mask to this stage's scores: what is left to explain "
        "besides the mask (0 at stage 5)"
    )
    top_key_agreement: float = Field(description="fraction of queries whose top key is the model's top key")
    top_keys: list[QueryTopKey]
    png_path: str | None = None


class AttentionReconstruction(Report):
    layer: int
    head: int
    kv_head: int
    family: str
    hidden_size: int = Field(description="the raw input x of stages 1–2 has this many dimensions")
    head_dim: int = Field(description="d_k: stage 2 divides x·xᵀ by sqrt(d_k)")
    scaling: float = Field(description="the model's factor on q·k (stages 3–5)")
    positional: str
    mask: str = Field(description="what the model's mask does on this text")
    softcap: float | None
    tokens: list[Token]
    stages: list[StageReport]
    positional_score_error: float = Field(
        description="max |stage-4 q·k·scale (soft-capped) − the model's captured pre-mask scores|"
    )
    model_weight_error: float = Field(description="max |stage-5 weights − the model's own attention weights|")
    matches_model: bool = Field(description=f"model_weight_error ≤ {PARITY_TOLERANCE}")
