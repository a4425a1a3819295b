"""ablate_heads' words: the summary and findings, written from the effect sizes the plan measured."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent_tools.analysis.ablation import EFFECT_FLOOR, TIE_MARGIN
from agent_tools.analysis.metrics import BASELINE_SIGMAS
from agent_tools.schemas import Finding
from agent_tools.tools.ablate_heads.models import (
    AblationBaseline,
    AblationReport,
    DirectLogitAttribution,
    PositionEffect,
)
from agent_tools.wording import head_name, listed, random_heads

BEYOND_RULE = f"beyond chance: more than max({BASELINE_SIGMAS:g} × the draws' sd, {EFFECT_FLOOR:g}) from their mean"
METHOD_WORDS = {
    "mean": "mean-ablation: output replaced by its mean over the text's positions",
    "resample": "resample-ablation",
    "zero": "zero-ablation, out-of-distribution: a head never writes 0 in normal use",
}


@dataclass(frozen=True)
class Ablated:
    """What was removed, from how long a text."""

    heads: Sequence[str]  # "L.H" labels
    method: str
    tokens: int
    resample_source: str | None = None  # method resample: what was copied in

    @property
    def how(self) -> str:
        if self.method == "resample":
            return f"resample-ablation: output taken from {self.resample_source} at the same position"
        return METHOD_WORDS.get(self.method, self.method)


@dataclass(frozen=True)
class EmbeddingEffect:
    """An encoder's output change under the ablation, as 1 − cos (unrounded)."""

    pooled: float  # between the mean-pooled embeddings
    mean: float  # per token, averaged
    peak_position: int  # the token that turned most
    peak_token: str
    peak: float


def position_findings(largest: Sequence[PositionEffect], *, embedding: bool) -> list[Finding]:
    """The three positions whose next-token distribution (an encoder: whose output embedding) moved most."""
    return [
        Finding(
            kind="embedding_change" if embedding else "next_token_kl",
            position=p.position,
            token=p.token,
            value=p.value,
            detail=f"token {p.position} {p.token!r}'s output embedding turns by 1 − cos = {p.value:.4g}"
            if embedding
            else f"at position {p.position} {p.token!r} the next-token distribution moves by KL {p.value:.4g}",
        )
        for p in largest[:3]
    ]


def _baseline_words(baseline: AblationBaseline | None, unit: str) -> str:
    if baseline is None:
        return " (no random-head baseline: see notes)"
    mean, sd = baseline.effect
    chance = {"raises": "beyond chance", "lowers": "beyond chance", "within": "within chance"}
    said = chance.get(baseline.effect_direction, baseline.effect_direction)
    return f"; {random_heads(baseline.draws, baseline.heads_per_draw)}: {mean:+.4f} ± {sd:.4f}{unit} — {said}"


def _top_text(report: AblationReport) -> str:
    top_clean, top_ablated = report.top_token_clean, report.top_token_ablated
    p_clean, p_ablated = report.top_token_probability_clean, report.top_token_probability_ablated
    if report.top_token_change == "same":
        return f"the top next token stays {top_clean!r} (p {p_clean:.3f} -> {p_ablated:.3f})"
    if report.top_token_change == "tie":
        return (
            f"the top next token becomes a tie, not a flip: {top_ablated!r} p {report.top_token_probability_new:.3f} "
            f"vs {top_clean!r} {p_ablated:.3f} under the ablation (within the {TIE_MARGIN} margin)"
        )
    return (
        f"the top next token flips from {top_clean!r} to {top_ablated!r} (p {report.top_token_probability_new:.3f} "
        f"vs {p_ablated:.3f} under the ablation)"
    )


def next_token_summary(ablated: Ablated, report: AblationReport, baseline: AblationBaseline | None) -> str:
    """The loss change in words against random heads, the KL against theirs, where it peaks, the top next token:
    from the report's (rounded) numbers."""
    who = f"Removing {listed(ablated.heads, 8)} ({ablated.how}) on {ablated.tokens} tokens"
    if report.loss_clean is not None and report.loss_ablated is not None:
        change = report.loss_ablated - report.loss_clean
        way = "raises" if change > 0 else "lowers" if change < 0 else "leaves"
        loss = (
            f"{who} {way} the loss on the text by {abs(change):.4f} nats ({report.loss_clean:.4f} -> "
            f"{report.loss_ablated:.4f}){_baseline_words(baseline, ' nats')}."
        )
    else:
        loss = f"{who}: the text is one token, so no loss is measured."
    kl_base = ""
    if baseline is not None and baseline.kl_mean is not None:
        size = {"larger": "larger than", "smaller": "smaller than", "within": "within the range of"}
        kl_base = (
            f" (random: {baseline.kl_mean[0]:.4g} ± {baseline.kl_mean[1]:.4g}: "
            f"{size.get(baseline.kl_size or 'within', 'within the range of')} random heads)"
        )
    peak = report.largest_effects[0]
    return (
        f"{loss} KL of the next-token distribution {report.kl_mean:.4g} nats on average{kl_base}, "
        f"{report.kl_last_position:.4g} at the last position (largest {peak.value:.4g} at position "
        f"{peak.position} {peak.token!r}); {_top_text(report)}."
    )


def embedding_baseline_text(baseline: AblationBaseline | None) -> str:
    """The pooled embedding change against random heads'."""
    if baseline is None:
        return " No random-head baseline (see notes)."
    mean, sd = baseline.effect
    word = {"raises": "larger than", "lowers": "smaller than", "within": "within the range of"}
    return (
        f" {random_heads(baseline.draws, baseline.heads_per_draw)} turn it by {mean:.4g} ± {sd:.4g}: "
        f"{word.get(baseline.effect_direction, 'within the range of')} random heads."
    )


def embedding_summary(ablated: Ablated, effect: EmbeddingEffect) -> str:
    """How far the pooled embedding turns, per token on average, and which token turned most."""
    return (
        f"Removing {listed(ablated.heads, 8)} ({ablated.how}) on {ablated.tokens} tokens turns the mean-pooled "
        f"embedding by 1 − cos = {effect.pooled:.4g}; per token {effect.mean:.4g} on average, most at position "
        f"{effect.peak_position} {effect.peak_token!r} ({effect.peak:.4g})."
    )


def dla_summary(dla: DirectLogitAttribution) -> str:
    """The ablated heads' direct write into the target logit and the head that writes most (norm scale frozen)."""
    ablated = sum(h.logit for h in dla.ablated)
    each = ", ".join(f"{h.layer}.{h.head} {h.logit:+.3f}" for h in dla.ablated[:4])
    top = dla.top_heads[0]
    return (
        f" Direct logit attribution to {dla.token!r} (logit {dla.logit:.3f}; final {dla.final_norm} scale frozen): "
        f"the ablated heads write {ablated:+.3f} into it ({each}); the largest writer is "
        f"{head_name(top.layer, top.head)} {top.logit:+.3f}."
    )


def dla_finding(dla: DirectLogitAttribution) -> Finding:
    top = dla.top_heads[0]
    return Finding(
        kind="direct_logit_attribution",
        layer=top.layer,
        head=top.head,
        value=top.logit,
        detail=f"{head_name(top.layer, top.head)} writes {top.logit:+.3f} directly into the logit of {dla.token!r} "
        f"(final {dla.final_norm} scale frozen); all heads together {dla.heads_total:+.3f} of {dla.logit:.3f}",
    )
