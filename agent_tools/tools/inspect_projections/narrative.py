"""inspect_projections' words: the findings and the summary, written from numbers the plan has already computed.

One function per finding kind; the summary is built from the same numbers. :class:`Measured` carries what
the words need: the report, and the W_Q·W_Kᵀ shares and the scale unrounded, as the text reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_tools.consumers.head_inputs import mask_phrase
from agent_tools.schemas import Finding, NextCall, head_label, text_follow_up
from agent_tools.tools.inspect_projections.models import (
    InspectProjectionsInput,
    ProjectionReport,
    SharedKVHead,
)
from agent_tools.wording import head_name


@dataclass(frozen=True)
class Measured:
    """One head's report (spectra, subspaces, the heads sharing its KV head, the counterfactual) and the numbers its
    words read unrounded: the W_Q·W_Kᵀ shares and the model's scale."""

    report: ProjectionReport
    symmetric: float  # share of W_Q W_Kᵀ in its symmetric part
    identity: float  # cosine of W_Q W_Kᵀ with the identity
    scale: float  # the model's effective scale


def spectra_finding(r: ProjectionReport) -> Finding:
    """Effective ranks of the projections and circuits, and the projections' spectral norms."""
    w_q, w_k, w_v, _, qk, ov = r.matrices
    return Finding(
        kind="projection_spectra",
        layer=r.layer,
        head=r.head,
        value=w_q.effective_rank,
        detail=(
            f"effective rank of {r.head_dim} possible: W_Q {w_q.effective_rank:.1f}, W_K {w_k.effective_rank:.1f}, "
            f"W_V {w_v.effective_rank:.1f}, QK circuit {qk.effective_rank:.1f}, "
            f"OV circuit {ov.effective_rank:.1f}; spectral norms W_Q {w_q.spectral_norm:.3g}, "
            f"W_K {w_k.spectral_norm:.3g}, W_V {w_v.spectral_norm:.3g}"
        ),
    )


def subspaces_finding(m: Measured) -> Finding:
    """How much the input subspaces W_Q and W_K read overlap, against random subspaces."""
    angles = m.report.query_key_angles
    return Finding(
        kind="query_key_subspaces",
        layer=m.report.layer,
        head=m.report.head,
        value=angles.mean_cos2,
        detail=(
            f"W_Q and W_K read input subspaces with mean cos² {angles.mean_cos2:.3f} (random: "
            f"{angles.random_mean_cos2:.3f}); principal angles {angles.smallest_deg:.1f}° to "
            f"{angles.largest_deg:.1f}° (median {angles.median_deg:.1f}°); W_Q·W_Kᵀ is {m.symmetric:.0%} "
            f"symmetric, identity alignment {m.identity:.3f}"
        ),
    )


def counterfactual_finding(m: Measured) -> Finding:
    """What attention would be with Q = K = V = x, against the model's."""
    cf = m.report.counterfactual
    return Finding(
        kind="no_projection_counterfactual",
        layer=m.report.layer,
        head=m.report.head,
        value=cf.self_argmax_fraction,
        detail=(
            f"with Q = K = V = x (scale {m.scale:.4g}, {mask_phrase(cf.mask)}) "
            f"{cf.self_argmax_fraction:.0%} of queries attend mostly to themselves "
            f"(model: {cf.model_self_argmax_fraction:.0%}); entropy "
            f"{cf.mean_entropy:.3f} vs the model's {cf.model_mean_entropy:.3f} nats; mean JS divergence "
            f"{cf.mean_js_divergence:.3f} nats"
        ),
    )


def largest_effect_finding(r: ProjectionReport) -> Finding:
    """The query whose attention the projections change most."""
    cf = r.counterfactual
    worst = cf.max_js_position
    row = cf.rows[worst]
    return Finding(
        kind="largest_projection_effect",
        layer=r.layer,
        head=r.head,
        position=worst,
        token=row.token,
        value=cf.max_js_divergence,
        detail=(
            f"the projections change query {worst} {row.token!r} most "
            f"(JS {cf.max_js_divergence:.3f} nats): "
            f"it reads {row.model_top_token!r} (pos {row.model_top_key}) instead of "
            f"{row.counterfactual_top_token!r} (pos {row.counterfactual_top_key})"
        ),
    )


def shared_kv_finding(shared: SharedKVHead, layer: int, kv_head: int) -> Finding:
    """How alike another query head reading the same K and V is."""
    return Finding(
        kind="shared_kv_head",
        layer=layer,
        head=shared.head,
        value=shared.map_js_divergence,
        detail=(
            f"head {shared.head} shares KV head {kv_head}: W_Q cosine {shared.w_q_cosine:.3f}, "
            f"W_Q subspace mean cos² {shared.w_q_mean_cos2:.3f}, map JS divergence "
            f"{shared.map_js_divergence:.3f} nats, same top key for {shared.top_key_agreement:.0%} of queries"
        ),
    )


def findings(m: Measured) -> list[Finding]:
    """Spectra, subspaces, the counterfactual, its largest effect, then one finding per head sharing the KV head."""
    r = m.report
    shared = [shared_kv_finding(s, r.layer, r.kv_head) for s in r.shared_kv_heads]
    return [spectra_finding(r), subspaces_finding(m), counterfactual_finding(m), largest_effect_finding(r), *shared]


def _sharing_text(r: ProjectionReport) -> str:
    shared = r.shared_kv_heads
    if not shared:
        return f"It has its own K and V (no grouped-query attention in {r.family})."
    closest = min(shared, key=lambda s: s.map_js_divergence)
    return (
        f"It shares KV head {r.kv_head} with heads {', '.join(str(s.head) for s in shared)}; the most "
        f"similar is head {closest.head} (map JS {closest.map_js_divergence:.3f} nats, W_Q cosine "
        f"{closest.w_q_cosine:.3f})."
    )


def summary(r: ProjectionReport) -> str:
    """Ranks, the W_Q/W_K overlap, the counterfactual and the KV sharing, in one paragraph."""
    w_q, w_k, w_v = r.matrices[0], r.matrices[1], r.matrices[2]
    cf, angles = r.counterfactual, r.query_key_angles
    return (
        f"Layer {r.layer} head {r.head}: W_Q/W_K/W_V effective ranks {w_q.effective_rank:.1f}/"
        f"{w_k.effective_rank:.1f}/{w_v.effective_rank:.1f} of {r.head_dim}; W_Q and W_K read subspaces with mean "
        f"cos² {angles.mean_cos2:.3f} (random {angles.random_mean_cos2:.3f}). Without projections (Q = K = V = x, "
        f"same scale and mask) {cf.self_argmax_fraction:.0%} of queries would attend mostly to themselves (model: "
        f"{cf.model_self_argmax_fraction:.0%}), entropy {cf.mean_entropy:.3f} vs {cf.model_mean_entropy:.3f} nats, "
        f"mean JS divergence {cf.mean_js_divergence:.3f} nats. {_sharing_text(r)}"
    )


def next_calls(args: InspectProjectionsInput, report: ProjectionReport) -> list[NextCall]:
    """Rebuild the head step by step, see its map, and whether it matters."""
    where, name = {"layer": report.layer, "head": report.head}, head_name(report.layer, report.head)
    return [
        text_follow_up(
            args,
            "reconstruct_attention",
            where,
            f"{name}'s map rebuilt stage by stage: which step the projections' effect comes from",
        ),
        text_follow_up(args, "show_attention", where, f"{name}'s map, query by query"),
        text_follow_up(
            args,
            "ablate_heads",
            {"heads": [head_label(report.layer, report.head)]},
            f"whether {name} matters for the output",
        ),
    ]
