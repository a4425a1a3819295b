"""scaling_experiment's arguments and report: the pydantic models an agent reads, with their descriptions."""

from __future__ import annotations

import math
from typing import Annotated, get_origin

from pydantic import AfterValidator, BaseModel, Field

from agent_tools.analysis.metrics import SATURATION
from agent_tools.schemas import DetailInput, Report, Rounded

DESCRIPTION = (
    "Trains a tiny attention head (CPU, seconds) with and without 1/sqrt(d_k) at small and large d_k: loss, "
    "gradient curves. Use to show why scaling matters; no model."
)
VANISHED = 1e-6  # a W_q gradient norm below this counts as vanished
CURVE_POINTS = 30  # logged points per run when log_every is omitted


def significant(value: float) -> float:
    """Three significant digits (gradient norms span many orders of magnitude); NaN and inf kept."""
    return float(f"{value:.3g}") if math.isfinite(value) else value


Significant3 = Annotated[float, AfterValidator(significant)]
MAX_STEPS = 3000  # training steps per run at most


class ScalingExperimentInput(DetailInput):
    small_head_dim: int = Field(default=16, ge=1, le=512, description="d_k")
    large_head_dim: int = Field(default=1024, ge=2, le=4096, description="d_k")
    steps: int = Field(default=300, ge=1, le=MAX_STEPS, description="per run")
    learning_rate: float = Field(default=1.0, gt=0.0, le=100.0, allow_inf_nan=False, description="SGD learning rate")
    items: int = Field(default=16, ge=2, le=128, description="(key, label) items per example the query must search")
    batch: int = Field(default=64, ge=1, le=512, description="examples per step")
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="same seed, same numbers")
    log_every: int | None = Field(
        default=None,
        ge=1,
        le=MAX_STEPS,
        description=f"log every N steps; omitted = about {CURVE_POINTS} points per run",
    )


class ExperimentCurve(BaseModel):
    head_dim: int
    scaled: bool = Field(description="scores divided by sqrt(d_k)")
    steps: list[int]
    loss: list[Rounded]
    accuracy: list[Rounded]
    grad_norm_q: list[Significant3] = Field(description="‖∂loss/∂W_q‖ at each logged step (3 significant digits)")
    grad_norm_k: list[Significant3]
    attention_entropy: list[Rounded] = Field(description="mean attention entropy, nats (max log(items))")
    saturated_fraction: list[Rounded] = Field(description=f"fraction of queries with max weight ≥ {SATURATION}")
    target_weight: list[Rounded] = Field(description="mean weight on the item the query asks for")
    initial_entropy: Rounded
    initial_saturated_fraction: Rounded
    initial_grad_norm_q: Significant3
    final_loss: Rounded = Field(description="mean loss over the last 20% of logged points")
    final_accuracy: Rounded = Field(description="mean accuracy over the last 20% of logged points")
    vanished_gradient_fraction: Rounded = Field(description=f"logged steps with ‖∂loss/∂W_q‖ < {VANISHED}")
    median_grad_norm_q: Significant3


CURVES = tuple(name for name, field in ExperimentCurve.model_fields.items() if get_origin(field.annotation) is list)
"""The curves a run logs, one value per logged step (``steps``, ``loss``, ...), in the report's order."""


class ScalingExperimentReport(Report):
    task: str
    d_model: int
    items: int
    labels: int
    batch: int
    steps: int
    learning_rate: float
    seed: int
    max_entropy: Rounded = Field(description="log(items): entropy of uniform attention")
    chance_loss: Rounded = Field(description="cross-entropy of a uniform guess, log(labels)")
    answer_gain: float = Field(description="g: logits = g · Σ_j α_j onehot(label_j)")
    confident_wrong_loss: Rounded = Field(
        description="loss when all attention sits on one wrong item: ln(e^g + labels − 1); a saturated head that "
        "picks the wrong item pays this, which is why unscaled runs can end above chance_loss"
    )
    runs: list[ExperimentCurve]
