"""reconstruct_attention's arguments and report: the pydantic models an agent reads, with their descriptions."""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent_tools.analysis.reconstruct import ReconstructionStage
from agent_tools.schemas import Report, Rounded, Rounded6, TextInput, Token
from agent_tools.stack_input import StackInput, StackReport

PARITY_TOLERANCE = 1e-5  # stage 5 must equal the model's weights to this (the contract)

DESCRIPTION = (
    "One head's map rebuilt step by step (x·xᵀ, ÷sqrt(d_k), W_Q/W_K, positions, mask, softmax). Use to see which "
    "step makes it attend as it does."
)


class ReconstructAttentionInput(TextInput, StackInput):
    layer: int
    head: int
    mask_every_stage: bool = Field(
        default=False,
        description="mask stages 1–4 too (default: only stage 5, as in the recipe)",
    )
    png: bool = Field(default=False, description="write a PNG per stage (artifact)")


class QueryTopKey(BaseModel):
    position: int = Field(description="query position")
    token: str
    key_position: int = Field(description="the key this query weights most at this stage")
    key_token: str
    weight: Rounded


class StageReport(BaseModel):
    stage: int = Field(description="1..5")
    name: ReconstructionStage
    added: str = Field(description="what this stage adds to the previous one")
    scale: Rounded6 = Field(description="factor the dot products are multiplied by at this stage")
    divisor: Rounded6 = Field(
        description="what the dot products are divided by at this stage (1 / scale): 1 at stage 1, sqrt(d_k) at "
        "stage 2, the model's own 1/scale (sqrt(d_k) for the standard scale) at stages 3–5"
    )
    masked: bool = Field(description="whether the model's mask is applied at this stage")
    mean_entropy: Rounded = Field(description="mean entropy of the softmax rows, nats")
    mean_normalised_entropy: Rounded = Field(description="mean entropy / log(keys visible): 0 one key, 1 uniform")
    mean_max_weight: Rounded
    self_share: Rounded = Field(description="mean weight a query puts on itself")
    logit_std: Rounded = Field(description="mean over queries of the standard deviation of its logits")
    mean_js_to_model: Rounded = Field(description="mean per-query Jensen–Shannon divergence to the model's map, nats")
    masked_js_to_model: Rounded = Field(
        description="the same after applying the model's mask to this stage's scores: what is left to explain "
        "besides the mask (0 at stage 5)"
    )
    top_key_agreement: Rounded = Field(description="fraction of queries whose top key is the model's top key")
    top_keys: list[QueryTopKey]
    png_path: str | None = None


class HeadSinkShare(BaseModel):
    """One head's learned sink (GPT-OSS) beside the first-token sink: where its spare attention goes."""

    head: int
    sink_logit: Rounded = Field(description="the head's learned sink logit (an extra softmax column)")
    sink_share: Rounded = Field(description="mean over queries of the weight the sink column takes")
    first_token_share: Rounded = Field(description="mean over queries of the weight on the first token (key 0)")


class AttentionReconstruction(Report, StackReport):
    layer: int
    head: int
    kv_head: int
    family: str
    hidden_size: int = Field(description="the raw input x of stages 1–2 has this many dimensions")
    head_dim: int = Field(description="d_k: stage 2 divides x·xᵀ by sqrt(d_k)")
    scaling: Rounded6 = Field(description="the model's factor on q·k (stages 3–5)")
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
    score_terms: list[str] = Field(
        default_factory=list,
        description="additive score terms the family adds and the stages show (relative position bias, ALiBi, "
        "c2p/p2c, sink logit)",
    )
    head_sinks: list[HeadSinkShare] = Field(
        default_factory=list, description="families with learned sink logits: every head of the layer's sink"
    )
