"""scaling_experiment's words: the summary, findings and task text, written from the finished training curves.

Pure functions of the report's numbers (and single curves), so the text can be read (and changed) without
training anything.
"""

from __future__ import annotations

import math

from agent_tools.analysis.metrics import SATURATION
from agent_tools.schemas import Finding, NextCall, follow_up
from agent_tools.tools.scaling_experiment.models import (
    MAX_STEPS,
    VANISHED,
    ExperimentCurve,
    ScalingExperimentInput,
    ScalingExperimentReport,
)
from agent_tools.wording import SAMPLE_TEXT


def task(d_model: int, labels: int, gain: float) -> str:
    """What the model is trained on, in one paragraph."""
    return (
        f"items are random {d_model}-d vectors with one of {labels} labels; the query is a noisy copy of one item; "
        f"logits = {gain:g} · Σ_j α_j onehot(label_j) with α = softmax(x_q W_q (c_j W_k)ᵀ · s); only W_q, W_k learn; "
        "weights start N(0, 1/d_model) so q and k components have unit variance"
    )


def run_finding(c: ExperimentCurve) -> Finding:
    """One run: where its attention and W_q gradient start, how often the gradient vanished, where it ends."""
    return Finding(
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


def findings(report: ScalingExperimentReport) -> list[Finding]:
    """One finding per run, in the order the runs were trained."""
    return [run_finding(c) for c in report.runs]


def summary(n: ScalingExperimentReport) -> str:
    """The set-up, the four final losses, and how the unscaled large-d_k run starts saturated and stalls (from a
    report whose runs are filled in, in the order they were trained: small d_k first, each with then without)."""
    small_scaled, small_raw, large_scaled, large_raw = n.runs
    small, large = small_scaled.head_dim, large_scaled.head_dim
    return (
        f"One attention head retrieving the label of 1 of {n.items} items ({n.steps} SGD steps, lr "
        f"{n.learning_rate:g}, seed {n.seed}; chance loss {math.log(n.labels):.2f}). With 1/sqrt(d_k) the final "
        f"loss is {small_scaled.final_loss:.3f} at d_k={small} and {large_scaled.final_loss:.3f} at "
        f"d_k={large}; without it {small_raw.final_loss:.3f} and {large_raw.final_loss:.3f} "
        f"(accuracy {small_raw.final_accuracy:.0%} and {large_raw.final_accuracy:.0%}). Unscaled at "
        f"d_k={large} the attention starts saturated (entropy {large_raw.initial_entropy:.3f} of "
        f"{math.log(n.items):.2f} nats, {large_raw.initial_saturated_fraction:.0%} of queries ≥ "
        f"{SATURATION}) "
        f"and ‖∂L/∂W_q‖ vanishes (< {VANISHED:g}) on {large_raw.vanished_gradient_fraction:.0%} of logged steps."
    )


def next_calls(args: ScalingExperimentInput, report: ScalingExperimentReport) -> list[NextCall]:
    """Longer training when an unscaled run has not converged (slow, or stuck?), then the scale on a real model."""
    calls = []
    stalled = [c for c in report.runs if not c.scaled and c.final_accuracy < 0.9]
    if stalled and args.steps < MAX_STEPS:
        steps = min(MAX_STEPS, args.steps * 4)
        calls.append(
            follow_up(
                "scaling_experiment",
                args.model_dump(exclude_defaults=True, exclude={"detail"}) | {"steps": steps},
                f"{steps} steps: whether the unscaled d_k={stalled[-1].head_dim} run is only slow or stuck",
            )
        )
    calls.append(
        follow_up(
            "explain_scaling",
            {"text": SAMPLE_TEXT, "layer": 0},
            "the same scale in a real model's layer: score variance, saturation, Jacobian",
        )
    )
    calls.append(follow_up("describe_model", {}, "the real model's d_k and score scale"))
    return calls
