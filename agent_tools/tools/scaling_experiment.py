"""scaling_experiment: "my model refused to converge", reproduced on a tiny head with and without 1/sqrt(d_k)."""

from __future__ import annotations

import math
import statistics

from pydantic import BaseModel, Field

from agent_tools.analysis.scaling import SATURATION, ExperimentRun, train_retrieval
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.schemas import Finding, Report, ToolInput, rounded
from agent_tools.tools.registry import ToolSpec

VANISHED = 1e-6  # a W_q gradient norm below this counts as vanished
CURVE_POINTS = 30  # logged points per run when log_every is omitted


class ScalingExperimentInput(ToolInput):
    small_head_dim: int = Field(default=16, ge=1, le=512, description="the small d_k")
    large_head_dim: int = Field(default=1024, ge=2, le=4096, description="the large d_k")
    steps: int = Field(default=300, ge=1, le=3000, description="SGD steps per run")
    learning_rate: float = Field(default=1.0, gt=0.0, le=100.0, allow_inf_nan=False, description="SGD learning rate")
    items: int = Field(default=16, ge=2, le=128, description="(key, label) items per example the query must search")
    batch: int = Field(default=64, ge=1, le=512, description="examples per step")
    seed: int = Field(
        default=0, ge=0, le=2**31 - 1, description="fixes data and initialisation: same seed, same numbers"
    )
    log_every: int | None = Field(
        default=None, ge=1, le=3000, description=f"log every N steps; omitted = about {CURVE_POINTS} points per run"
    )


class ExperimentCurve(BaseModel):
    head_dim: int
    scaled: bool = Field(description="scores divided by sqrt(d_k)")
    steps: list[int]
    loss: list[float]
    accuracy: list[float]
    grad_norm_q: list[float] = Field(description="‖∂loss/∂W_q‖ at each logged step (3 significant digits)")
    grad_norm_k: list[float]
    attention_entropy: list[float] = Field(description="mean attention entropy, nats (max log(items))")
    saturated_fraction: list[float] = Field(description=f"fraction of queries with max weight ≥ {SATURATION}")
    target_weight: list[float] = Field(description="mean weight on the item the query asks for")
    initial_entropy: float
    initial_saturated_fraction: float
    initial_grad_norm_q: float
    final_loss: float = Field(description="mean loss over the last 20% of logged points")
    final_accuracy: float = Field(description="mean accuracy over the last 20% of logged points")
    vanished_gradient_fraction: float = Field(description=f"logged steps with ‖∂loss/∂W_q‖ < {VANISHED}")
    median_grad_norm_q: float


class ScalingExperimentReport(Report):
    task: str
    d_model: int
    items: int
    labels: int
    batch: int
    steps: int
    learning_rate: float
    seed: int
    max_entropy: float = Field(description="log(items): entropy of uniform attention")
    chance_loss: float = Field(description="cross-entropy of a uniform guess, log(labels)")
    runs: list[ExperimentCurve]


def _significant(value: float, digits: int = 3) -> float:
    return float(f"{value:.{digits}g}") if math.isfinite(value) else value


def _curve(run: ExperimentRun) -> ExperimentCurve:
    tail = max(1, len(run.loss) // 5)
    return ExperimentCurve(
        head_dim=run.head_dim,
        scaled=run.scaled,
        steps=run.steps,
        loss=[rounded(v) for v in run.loss],
        accuracy=[rounded(v) for v in run.accuracy],
        grad_norm_q=[_significant(v) for v in run.grad_norm_q],
        grad_norm_k=[_significant(v) for v in run.grad_norm_k],
        attention_entropy=[rounded(v) for v in run.attention_entropy],
        saturated_fraction=[rounded(v) for v in run.saturated_fraction],
        target_weight=[rounded(v) for v in run.target_weight],
        initial_entropy=rounded(run.attention_entropy[0]),
        initial_saturated_fraction=rounded(run.saturated_fraction[0]),
        initial_grad_norm_q=_significant(run.grad_norm_q[0]),
        final_loss=rounded(statistics.fmean(run.loss[-tail:])),
        final_accuracy=rounded(statistics.fmean(run.accuracy[-tail:])),
        vanished_gradient_fraction=rounded(sum(g < VANISHED for g in run.grad_norm_q) / len(run.grad_norm_q)),
        median_grad_norm_q=_significant(statistics.median(run.grad_norm_q)),
    )


def scaling_experiment(inspector: Inspector, args: ScalingExperimentInput) -> ScalingExperimentReport:
    """Train a one-head attention model on a synthetic retrieval task, with and without the 1/sqrt(d_k) factor,
    at a small and a large d_k; return loss curves, W_q/W_k gradient norms and attention entropy over steps.

    CPU, seconds; deterministic for a seed. No pretrained model is involved.
    """
    if args.small_head_dim >= args.large_head_dim:
        msg = f"small_head_dim {args.small_head_dim} must be below large_head_dim {args.large_head_dim}"
        raise InvalidInputError(msg, field="small_head_dim")
    d_model, labels = 32, 16
    log_every = args.log_every or max(1, args.steps // CURVE_POINTS)
    runs = [
        train_retrieval(
            head_dim,
            scaled=scaled,
            steps=args.steps,
            batch=args.batch,
            items=args.items,
            d_model=d_model,
            labels=labels,
            learning_rate=args.learning_rate,
            log_every=log_every,
            seed=args.seed,
        )
        for head_dim in (args.small_head_dim, args.large_head_dim)
        for scaled in (True, False)
    ]
    curves = [_curve(run) for run in runs]
    findings = [
        Finding(
            kind="scaled_run" if c.scaled else "unscaled_run",
            value=c.final_loss,
            detail=(
                f"d_k={c.head_dim} {'with' if c.scaled else 'without'} 1/sqrt(d_k): initial attention entropy "
                f"{c.initial_entropy:.3f} nats ({c.initial_saturated_fraction:.0%} of queries saturated), "
                f"‖∂L/∂W_q‖ starts at {c.initial_grad_norm_q:.3g} (median {c.median_grad_norm_q:.3g}, below "
                f"{VANISHED:g} on {c.vanished_gradient_fraction:.0%} of logged steps); final loss {c.final_loss:.3f}, "
                f"accuracy {c.final_accuracy:.0%}"
            ),
        )
        for c in curves
    ]
    by = {(c.head_dim, c.scaled): c for c in curves}
    small, large = args.small_head_dim, args.large_head_dim
    summary = (
        f"One attention head retrieving the label of 1 of {args.items} items ({args.steps} SGD steps, lr "
        f"{args.learning_rate:g}, seed {args.seed}; chance loss {math.log(labels):.2f}). With 1/sqrt(d_k) the final "
        f"loss is {by[small, True].final_loss:.3f} at d_k={small} and {by[large, True].final_loss:.3f} at "
        f"d_k={large}; without it {by[small, False].final_loss:.3f} and {by[large, False].final_loss:.3f} "
        f"(accuracy {by[small, False].final_accuracy:.0%} and {by[large, False].final_accuracy:.0%}). Unscaled at "
        f"d_k={large} the attention starts saturated (entropy {by[large, False].initial_entropy:.3f} of "
        f"{math.log(args.items):.2f} nats, {by[large, False].initial_saturated_fraction:.0%} of queries ≥ "
        f"{SATURATION}) "
        f"and ‖∂L/∂W_q‖ vanishes (< {VANISHED:g}) on {by[large, False].vanished_gradient_fraction:.0%} of logged steps."
    )
    return ScalingExperimentReport(
        model="synthetic single-head retrieval model (no pretrained model)",
        summary=summary,
        findings=findings,
        task=(
            f"items are random {d_model}-d vectors with one of {labels} labels; the query is a noisy copy of one item; "
            "logits = 8 · Σ_j α_j onehot(label_j) with α = softmax(x_q W_q (c_j W_k)ᵀ · s); only W_q, W_k learn; "
            "weights start N(0, 1/d_model) so q and k components have unit variance"
        ),
        d_model=d_model,
        items=args.items,
        labels=labels,
        batch=args.batch,
        steps=args.steps,
        learning_rate=args.learning_rate,
        seed=args.seed,
        max_entropy=rounded(math.log(args.items)),
        chance_loss=rounded(math.log(labels)),
        runs=curves,
    )


SPEC = ToolSpec(
    name="scaling_experiment",
    description=(
        "Reproduce 'my attention model refused to converge': train a tiny single-head attention model on a "
        "synthetic retrieval task (CPU, seconds) with and without the 1/sqrt(d_k) factor at a small and a large "
        "d_k, and return loss and accuracy curves, gradient norms of W_q and W_k, attention entropy and "
        "saturation over steps. Deterministic for a seed; needs no pretrained model."
    ),
    input_model=ScalingExperimentInput,
    output_model=ScalingExperimentReport,
    run=scaling_experiment,
    example={"steps": 60},
)
