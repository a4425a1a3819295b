"""explain_scaling's words: the summary and findings, written from numbers the plan has already computed.

Pure functions of :class:`ScalingNumbers`, one per finding kind, so the text can be read (and changed) without
running a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent_tools.analysis.metrics import SATURATION
from agent_tools.schemas import Finding, NextCall, follow_up, rounded
from agent_tools.tools.explain_scaling.models import (
    ExplainScalingInput,
    HeadScoreVariance,
    ScaleSetting,
    ScalingReport,
    SyntheticRow,
)


@dataclass(frozen=True)
class ScalingNumbers:
    """What the pass measured on one layer. Means over heads are unrounded; rows are as the report states them."""

    layer: int
    head: int | None  # the head asked for; None = every head of the layer
    head_count: int  # heads measured
    head_dim: int
    scaling: float  # the factor the model multiplies q·k by
    raw_mean: float  # measured Var(q·k), mean over the heads
    scaled_mean: float  # measured Var of the scaled scores, mean over the heads
    predicted: float  # var(q)·var(k)·d_k, mean over the heads
    head_rows: list[HeadScoreVariance]
    model_setting: ScaleSetting  # the softmax at the model's own scale
    unscaled: ScaleSetting  # the softmax of raw q·k
    settings: list[ScaleSetting]  # every setting of the sweep, by increasing β
    monotone_rows: int
    monotone_violations: int
    synthetic: list[SyntheticRow]

    @property
    def ratio(self) -> float:
        """scaling · sqrt(d_k): 1 for the standard 1/sqrt(d_k)."""
        return self.scaling * math.sqrt(self.head_dim)

    @property
    def standard_scale(self) -> bool:
        return abs(self.ratio - 1) <= 1e-3

    @property
    def variance_ratio(self) -> float:
        """Measured over predicted Var(q·k) (infinite when nothing is predicted)."""
        return self.raw_mean / self.predicted if self.predicted > 0 else math.inf


def scale_finding(n: ScalingNumbers) -> Finding:
    """The model's factor next to 1/sqrt(d_k)."""
    return Finding(
        kind="scale",
        layer=n.layer,
        head=n.head,
        value=rounded(n.ratio),
        detail=(
            f"the model multiplies q·k by {n.scaling:.4g}; 1/sqrt({n.head_dim}) = {1 / math.sqrt(n.head_dim):.4g} "
            f"(ratio {n.ratio:.3g})"
        ),
    )


def score_variance_finding(n: ScalingNumbers) -> Finding:
    """Measured Var(q·k) against the isotropic prediction, and after scaling."""
    return Finding(
        kind="score_variance",
        layer=n.layer,
        head=n.head,
        value=rounded(n.variance_ratio),
        detail=(
            f"Var(q·k) = {n.raw_mean:.3g} measured vs {n.predicted:.3g} predicted by var(q)·var(k)·d_k; "
            f"after scaling {n.scaled_mean:.3g} (= {n.raw_mean:.3g} × {n.scaling:.4g}²)"
        ),
    )


def widest_head_finding(n: ScalingNumbers) -> Finding | None:
    """The head with the widest raw scores (None when only one head was measured)."""
    if len(n.head_rows) <= 1:
        return None
    wide = max(n.head_rows, key=lambda r: r.raw_variance)
    return Finding(
        kind="widest_head",
        layer=n.layer,
        head=wide.head,
        value=wide.raw_variance,
        detail=(
            f"L{n.layer}H{wide.head} has the widest scores: Var(q·k) = {wide.raw_variance:.3g} "
            f"({wide.ratio_isotropic:.2f}× the isotropic prediction, {wide.ratio_independent:.2f}× the "
            "prediction with component means)"
        ),
    )


def no_scaling_finding(n: ScalingNumbers) -> Finding:
    """What the softmax looks like on raw q·k, next to the model's scale."""
    unscaled, model = n.unscaled, n.model_setting
    return Finding(
        kind="no_scaling",
        layer=n.layer,
        head=n.head,
        value=unscaled.saturated_fraction,
        detail=(
            f"without 1/sqrt(d_k): {unscaled.saturated_fraction:.0%} of rows saturated (model: "
            f"{model.saturated_fraction:.0%}), mean max weight {unscaled.mean_max_weight:.3f} "
            f"(model {model.mean_max_weight:.3f}), Jacobian trace {unscaled.jacobian_trace:.3f} "
            f"(model {model.jacobian_trace:.3f})"
        ),
    )


def entropy_monotone_finding(n: ScalingNumbers) -> Finding:
    """dH/dβ ≤ 0: how many rows' entropy rose along the sweep (should be none)."""
    return Finding(
        kind="entropy_monotone",
        layer=n.layer,
        head=n.head,
        value=float(n.monotone_violations),
        detail=(
            f"dH/dβ = −β·Var_p(z) ≤ 0: entropy never rose with the scale on {n.monotone_rows} rows "
            f"({n.monotone_violations} violations); dH/dβ at the model's scale averages "
            f"{n.model_setting.entropy_derivative}"
        ),
    )


def synthetic_finding(n: ScalingNumbers) -> Finding | None:
    """The model-free demonstration at the smallest and largest d_k (None when it was not asked for)."""
    if not n.synthetic:
        return None
    small, large = n.synthetic[0], n.synthetic[-1]
    return Finding(
        kind="synthetic",
        value=large.dot_variance,
        detail=(
            f"random unit-variance q, k: Var(q·k) = {small.dot_variance:.3g} at d_k={small.head_dim} and "
            f"{large.dot_variance:.4g} at d_k={large.head_dim}; unscaled at d_k={large.head_dim} "
            f"{large.unscaled.saturated_fraction:.0%} of rows saturate and the Jacobian trace is "
            f"{large.unscaled.jacobian_trace:.3g}, scaled {large.scaled.saturated_fraction:.0%} and "
            f"{large.scaled.jacobian_trace:.3g}"
        ),
    )


def findings(n: ScalingNumbers) -> list[Finding]:
    """Scale, score variance, widest head, no scaling, entropy monotonicity, synthetic: those that apply."""
    found = [
        scale_finding(n),
        score_variance_finding(n),
        widest_head_finding(n),
        no_scaling_finding(n),
        entropy_monotone_finding(n),
        synthetic_finding(n),
    ]
    return [f for f in found if f is not None]


def summary(n: ScalingNumbers) -> str:
    """d_k and the scale, the measured vs predicted variance, and what dropping the scale does to the softmax."""
    where = f"layer {n.layer}" + (f" head {n.head}" if n.head is not None else f" ({n.head_count} heads)")
    model, unscaled = n.model_setting, n.unscaled
    scale = "= 1/sqrt(d_k)" if n.standard_scale else f"{n.ratio:.3g}× 1/sqrt(d_k)"
    return (
        f"In {where}, d_k = {n.head_dim} and scores are q·k × {n.scaling:.4g} ({scale}). Raw q·k has variance "
        f"{n.raw_mean:.3g} (var(q)·var(k)·d_k predicts {n.predicted:.3g}, ratio {n.raw_mean / n.predicted:.2f}); "
        f"scaled scores {n.scaled_mean:.3g}. Without the scale, rows saturate ({unscaled.saturated_fraction:.0%} "
        f"with max ≥ {SATURATION} vs {model.saturated_fraction:.0%}), entropy falls from {model.entropy:.3f} to "
        f"{unscaled.entropy:.3f} nats and the gradient the softmax passes back shrinks: Jacobian trace 1 − Σp² "
        f"{model.jacobian_trace:.3f} → {unscaled.jacobian_trace:.3f}, ‖J‖_F "
        f"{model.jacobian_frobenius:.3f} → {unscaled.jacobian_frobenius:.3f}."
    )


def next_calls(args: ExplainScalingInput, report: ScalingReport) -> list[NextCall]:
    """The widest head's map, the layer's collapse check, and the training experiment at this d_k."""
    widest = max(report.head_variances, key=lambda r: r.raw_variance, default=None)
    calls = []
    if widest is not None:
        calls.append(
            follow_up(
                "show_attention",
                {"text": args.text, "layer": report.layer, "head": widest.head},
                f"the map of L{report.layer}H{widest.head}, the head with the widest scores",
                model=args.model,
            )
        )
    calls.append(
        follow_up(
            "diagnose_collapse",
            {"text": args.text, "layers": [report.layer]},
            f"whether layer {report.layer}'s heads collapse on this text",
            model=args.model,
        )
    )
    if report.head_dim < 1024:
        calls.append(
            follow_up(
                "scaling_experiment",
                {"small_head_dim": min(report.head_dim, 512)},
                f"train a tiny head with and without 1/sqrt(d_k) at d_k = {min(report.head_dim, 512)} and 1024",
            )
        )
    return calls
