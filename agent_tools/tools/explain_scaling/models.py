"""explain_scaling's arguments and report: the pydantic models an agent reads, with their descriptions."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, Field
from pydantic_core import PydanticCustomError

from agent_tools.analysis.metrics import SATURATION
from agent_tools.analysis.scaling import SYNTHETIC_HEAD_DIMS, SettingKind
from agent_tools.schemas import Report, Rounded, Rounded6, TextInput
from agent_tools.stack_input import StackInput, StackReport

DESCRIPTION = (
    "What 1/sqrt(d_k) does in one layer: Var(q·k) measured vs predicted; softmax entropy, saturation and gradient "
    "with and without it. Use for 'why sqrt(d_k)?'."
)
DEFAULT_TEMPERATURES = (0.25, 0.5, 2.0, 4.0)
NULL_TEMPERATURE = "Input should be a finite number > 0 (NaN and ±infinity have no JSON form: they arrive as null)"


def _not_null(value: object) -> object:
    """JSON writes NaN and ±infinity as null: say what is valid instead of "a valid number (got None)"."""
    if value is None:
        raise PydanticCustomError("finite_number", NULL_TEMPERATURE)
    return value


Temperature = Annotated[float, Field(gt=0.0, allow_inf_nan=False), BeforeValidator(_not_null)]


class ExplainScalingInput(TextInput, StackInput):
    layer: int
    head: int | None = Field(default=None, description="omitted = every head")
    temperatures: list[Temperature] | None = Field(
        default=None,
        min_length=1,
        max_length=16,
        description=(
            "temperatures τ > 0 (finite) dividing the model's own logits; τ = 1 is the model and is always "
            f"included; omitted = {list(DEFAULT_TEMPERATURES)}"
        ),
    )
    synthetic: bool = Field(
        default=True, description=f"add the model-free demonstration with random q, k for d_k in {SYNTHETIC_HEAD_DIMS}"
    )


class SoftmaxSummary(BaseModel):
    entropy: Rounded = Field(description="mean row entropy, nats")
    normalised_entropy: Rounded = Field(description="mean entropy / log(visible keys): 0 one key, 1 uniform")
    mean_max_weight: Rounded
    saturated_fraction: Rounded = Field(description=f"fraction of rows with max weight ≥ {SATURATION}")
    jacobian_trace: Rounded = Field(description="mean trace of the softmax Jacobian diag(p) − ppᵀ = 1 − Σp²")
    jacobian_frobenius: Rounded = Field(description="mean ‖diag(p) − ppᵀ‖_F: how much gradient the softmax passes back")


class ScaleSetting(SoftmaxSummary):
    kind: SettingKind
    temperature: float | None = Field(description="τ dividing the model's logits (None for no scaling)")
    beta: Rounded6 = Field(description="the factor multiplying raw q·k (model scale / τ, or 1 with no scaling)")
    entropy_derivative: Rounded | None = Field(
        description="mean dH/dβ for logits β·z_model at this β, closed form −β·Var_p(z) (≤ 0)"
    )


class HeadScoreVariance(BaseModel):
    head: int
    kv_head: int
    raw_variance: Rounded = Field(description="measured Var(q·k) over the (query, visible key) pairs")
    scaled_variance: Rounded = Field(description="measured Var(q·k · scale)")
    predicted_isotropic: Rounded = Field(description="mean_d Var(q_d) · mean_d Var(k_d) · d_k (textbook)")
    predicted_independent: Rounded = Field(
        description="Σ_d Var(q_d)Var(k_d) + Var(q_d)E[k_d]² + E[q_d]²Var(k_d): independent components, means kept"
    )
    ratio_isotropic: Rounded = Field(description="measured / predicted_isotropic")
    ratio_independent: Rounded = Field(description="measured / predicted_independent")
    q_variance: Rounded = Field(description="mean per-component variance of q over tokens")
    k_variance: Rounded = Field(description="mean per-component variance of k over tokens")
    q_mean_square: Rounded = Field(description="mean squared per-component mean of q (non-zero means break isotropy)")
    k_mean_square: Rounded


class SyntheticRow(BaseModel):
    head_dim: int
    dot_variance: Rounded = Field(description="Var(q·k) for unit-variance random q, k: ≈ d_k")
    scaled_variance: Rounded = Field(description="Var(q·k / sqrt(d_k)): ≈ 1")
    unscaled: SoftmaxSummary
    scaled: SoftmaxSummary


class ScalingReport(Report, StackReport):
    layer: int
    head: int | None
    heads: list[int]
    num_tokens: int
    head_dim: int = Field(description="d_k")
    scaling: Rounded6 = Field(description="the factor the model multiplies q·k by")
    inverse_sqrt_head_dim: Rounded6
    scaling_ratio: Rounded = Field(description="scaling · sqrt(d_k): 1 = the standard 1/sqrt(d_k)")
    standard_scale: bool
    softcap: float | None
    query_prescaled: bool
    raw_score_variance: Rounded = Field(description="measured Var(q·k), mean over the heads")
    scaled_score_variance: Rounded = Field(description="measured Var of the scaled scores, mean over the heads")
    predicted_variance: Rounded = Field(
        description="var(q)·var(k)·d_k from measured component variances, mean over heads"
    )
    variance_ratio: Rounded = Field(description="raw_score_variance / predicted_variance")
    head_variances: list[HeadScoreVariance]
    settings: list[ScaleSetting] = Field(description="model scale, no scaling and the temperature sweep (pooled rows)")
    entropy_monotone: bool = Field(description="every row's entropy is non-increasing as β grows along the sweep")
    monotonicity_violations: int
    rows_checked: int
    synthetic: list[SyntheticRow]
