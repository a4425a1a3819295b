"""inspect_projections' arguments and report: the pydantic models an agent reads, with their descriptions."""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent_tools.schemas import Report, Rounded, Rounded2, Rounded6, TextInput, Token, TokenRow
from agent_tools.stack_input import StackInput, StackReport

EFFECTIVE_RANK_DEFINITION = (
    "Roy & Vetterli (2007) entropy effective rank: exp(−Σ p_i ln p_i) with p_i = σ_i / Σσ; equals the rank when "
    "all non-zero singular values are equal, 1 for a rank-one matrix. stable_rank = ‖W‖_F² / ‖W‖_2²."
)

DESCRIPTION = (
    "One head's W_Q, W_K, W_V, W_O: spectra, ranks, what queries seek vs keys offer, the map without projections. "
    "Use to see what projections add."
)


class InspectProjectionsInput(TextInput, StackInput):
    layer: int
    head: int
    png: bool = Field(default=False, description="write the no-projection map as a PNG (artifact)")


class MatrixSpectrumReport(BaseModel):
    name: str = Field(description="W_Q, W_K, W_V, W_O, or a circuit: W_Q·W_Kᵀ (QK), W_V·W_O (OV)")
    shape: list[int] = Field(description="rows × columns in the x @ W convention (d_model × d_head for W_Q)")
    frobenius_norm: Rounded
    spectral_norm: Rounded = Field(description="largest singular value")
    effective_rank: Rounded = Field(description="Roy & Vetterli entropy effective rank (see effective_rank_definition)")
    stable_rank: Rounded = Field(description="‖W‖_F² / ‖W‖_2²")
    bias_norm: Rounded | None = Field(default=None, description="norm of the bias slice, where the family has one")
    singular_values: list[Rounded] = Field(description="descending")


class SubspaceAngles(BaseModel):
    first: str
    second: str
    angles_deg: list[Rounded2] = Field(description="principal angles, ascending, degrees (0 shared, 90 orthogonal)")
    smallest_deg: Rounded2
    median_deg: Rounded2
    largest_deg: Rounded2
    mean_cos2: Rounded = Field(description="mean cos² of the angles: 1 same subspace, 0 orthogonal")
    random_mean_cos2: Rounded = Field(description="mean cos² expected for random subspaces of these sizes")


class SharedKVHead(BaseModel):
    head: int = Field(description="another query head reading the same K and V")
    w_q_cosine: Rounded = Field(description="cosine between the two heads' W_Q slices (flattened)")
    w_q_mean_cos2: Rounded = Field(description="mean cos² of the principal angles between their W_Q subspaces")
    w_q_smallest_angle_deg: Rounded2
    map_js_divergence: Rounded = Field(description="mean per-query Jensen–Shannon divergence of the two maps, nats")
    top_key_agreement: Rounded = Field(description="fraction of queries whose top key is the same in both maps")
    mean_entropy: Rounded = Field(description="that head's mean entropy on this text, nats")


class CounterfactualRow(TokenRow):
    js_divergence: Rounded = Field(
        description="Jensen–Shannon divergence between the model's row and the counterfactual"
    )
    model_top_key: int
    model_top_token: str
    counterfactual_top_key: int
    counterfactual_top_token: str
    counterfactual_self_weight: Rounded


class NoProjectionCounterfactual(BaseModel):
    scale: Rounded6 = Field(description="the model's scale, applied to x·xᵀ")
    mask: str
    mean_entropy: Rounded = Field(description="nats")
    mean_normalised_entropy: Rounded
    self_argmax_fraction: Rounded = Field(
        description="fraction of queries whose largest weight is on themselves (queries that can read only "
        "themselves, like the first token under a causal mask, are left out)"
    )
    self_share: Rounded = Field(description="mean weight on the query itself")
    self_copy_cosine: Rounded = Field(
        description="mean cosine between (A x)_i and x_i with V = x: how much it copies itself"
    )
    model_mean_entropy: Rounded
    model_mean_normalised_entropy: Rounded
    model_self_argmax_fraction: Rounded
    model_self_share: Rounded
    mean_js_divergence: Rounded = Field(description="mean over queries, nats (maximum ln 2 ≈ 0.693)")
    max_js_divergence: Rounded
    max_js_position: int
    top_key_agreement: Rounded
    rows: list[CounterfactualRow]
    png_path: str | None = None


class ProjectionReport(Report, StackReport):
    layer: int
    head: int
    kv_head: int
    family: str
    hidden_size: int
    head_dim: int
    tokens: list[Token]
    effective_rank_definition: str
    matrices: list[MatrixSpectrumReport]
    query_key_angles: SubspaceAngles = Field(
        description="principal angles between the input subspaces W_Q and W_K read from (column spaces in R^d_model): "
        "'what I am looking for' vs 'what I have to offer'"
    )
    qk_symmetric_share: Rounded = Field(
        description="share of ‖W_Q W_Kᵀ‖_F² in its symmetric part (1 similarity-like, ≈0.5 random, 0 antisymmetric)"
    )
    qk_identity_alignment: Rounded = Field(
        description="cosine between W_Q W_Kᵀ and the identity (1 = plain x·x, 0 unrelated, < 0 prefers dissimilar)"
    )
    heads_sharing_kv: list[int] = Field(description="all query heads that read this head's KV head (itself included)")
    shared_kv_heads: list[SharedKVHead]
    counterfactual: NoProjectionCounterfactual
    model_weight_error: float = Field(
        description="parity check: max |softmax rebuilt from these weights − model's map|"
    )
