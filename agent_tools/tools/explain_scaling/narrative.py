"""explain_scaling's words: the summary and findings, written from numbers the plan has already computed.

Pure functions of :class:`ScalingNumbers` (the report and a few unrounded numbers), one per finding kind, so the
text can be read (and changed) without running a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent_tools.analysis.metrics import SATURATION
from agent_tools.analysis.scaling import SettingKind
from agent_tools.schemas import Finding, NextCall, follow_up, rounded, text_follow_up
from agent_tools.tools.explain_scaling.models import ExplainScalingInput, ScaleSetting, ScalingReport
from agent_tools.wording import head_name, scale_phrase


@dataclass(frozen=True)
class ScalingNumbers:
    """One layer's report and the numbers its words read unrounded: the model's factor and the score variances
    (means over the heads)."""

    report: ScalingReport
    scaling: float  # the factor the model multiplies q·k by
    raw_mean: float  # measured Var(q·k), mean over the heads
    scaled_mean: float  # measured Var of the scaled scores, mean over the heads
    predicted: float  # var(q)·var(k)·d_k, mean over the heads

    @property
    def ratio(self) -> float:
        """scaling · sqrt(d_k): 1 for the standard 1/sqrt(d_k)."""
        return self.scaling * math.sqrt(self.report.head_dim)

    def setting(self, kind: SettingKind) -> ScaleSetting:
        """The softmax at one setting of the sweep: ``model_scale`` or ``no_scaling`` (raw q·k)."""
        return next(s for s in self.report.settings if s.kind == kind)


def _finding(n: ScalingNumbers, kind: str, value: float, detail: str, head: int | None = None) -> Finding:
    """A finding about the layer measured (and the head asked for, unless ``head`` names another)."""
    return Finding(
        kind=kind, layer=n.report.layer, head=n.report.head if head is None else head, value=value, detail=detail
    )


def scale_finding(n: ScalingNumbers) -> Finding:
    """The model's factor next to 1/sqrt(d_k)."""
    d_k = n.report.head_dim
    return _finding(
        n,
        "scale",
        rounded(n.ratio),
        f"the model multiplies q·k by {n.scaling:.4g}; 1/sqrt({d_k}) = {1 / math.sqrt(d_k):.4g} (ratio {n.ratio:.3g})",
    )


def score_variance_finding(n: ScalingNumbers) -> Finding:
    """Measured Var(q·k) against the isotropic prediction, and after scaling."""
    return _finding(
        n,
        "score_variance",
        n.report.variance_ratio,
        f"Var(q·k) = {n.raw_mean:.3g} measured vs {n.predicted:.3g} predicted by var(q)·var(k)·d_k; "
        f"after scaling {n.scaled_mean:.3g} (= {n.raw_mean:.3g} × {n.scaling:.4g}²)",
    )


def widest_head_finding(n: ScalingNumbers) -> Finding | None:
    """The head with the widest raw scores (None when only one head was measured)."""
    rows = n.report.head_variances
    if len(rows) <= 1:
        return None
    wide = max(rows, key=lambda r: r.raw_variance)
    return _finding(
        n,
        "widest_head",
        wide.raw_variance,
        f"{head_name(n.report.layer, wide.head)} has the widest scores: Var(q·k) = {wide.raw_variance:.3g} "
        f"({wide.ratio_isotropic:.2f}× the isotropic prediction, {wide.ratio_independent:.2f}× the "
        "prediction with component means)",
        head=wide.head,
    )


def no_scaling_finding(n: ScalingNumbers) -> Finding:
    """What the softmax looks like on raw q·k, next to the model's scale."""
    unscaled, model = n.setting("no_scaling"), n.setting("model_scale")
    return _finding(
        n,
        "no_scaling",
        unscaled.saturated_fraction,
        f"without 1/sqrt(d_k): {unscaled.saturated_fraction:.0%} of rows saturated (model: "
        f"{model.saturated_fraction:.0%}), mean max weight {unscaled.mean_max_weight:.3f} "
        f"(model {model.mean_max_weight:.3f}), Jacobian trace {unscaled.jacobian_trace:.3f} "
        f"(model {model.jacobian_trace:.3f})",
    )


def entropy_monotone_finding(n: ScalingNumbers) -> Finding:
    """dH/dβ ≤ 0: how many rows' entropy rose along the sweep (should be none)."""
    r = n.report
    return _finding(
        n,
        "entropy_monotone",
        float(r.monotonicity_violations),
        f"dH/dβ = −β·Var_p(z) ≤ 0: entropy never rose with the scale on {r.rows_checked} rows "
        f"({r.monotonicity_violations} violations); dH/dβ at the model's scale averages "
        f"{n.setting('model_scale').entropy_derivative}",
    )


def synthetic_finding(n: ScalingNumbers) -> Finding | None:
    """The model-free demonstration at the smallest and largest d_k (None when it was not asked for)."""
    if not n.report.synthetic:
        return None
    small, large = n.report.synthetic[0], n.report.synthetic[-1]
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
    r = n.report
    where = f"layer {r.layer}" + (f" head {r.head}" if r.head is not None else f" ({len(r.heads)} heads)")
    model, unscaled = n.setting("model_scale"), n.setting("no_scaling")
    scale = scale_phrase(n.ratio)
    return (
        f"In {where}, d_k = {r.head_dim} and scores are q·k × {n.scaling:.4g} ({scale}). Raw q·k has variance "
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
            text_follow_up(
                args,
                "show_attention",
                {"layer": report.layer, "head": widest.head},
                f"the map of {head_name(report.layer, widest.head)}, the head with the widest scores",
            )
        )
    calls.append(
        text_follow_up(
            args,
            "diagnose_collapse",
            {"layers": [report.layer]},
            f"whether layer {report.layer}'s heads collapse on this text",
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
