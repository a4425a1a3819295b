"""ablate_heads' words: the summary and findings, written from the effect sizes the plan measured."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent_tools.analysis.ablation import BASELINE_SPREAD_MULTIPLE, EFFECT_FLOOR, TIE_MARGIN
from agent_tools.schemas import Finding
from agent_tools.tools.ablate_heads.models import AblationBaseline, DirectLogitAttribution, PositionEffect

BEYOND_RULE = (
    f"beyond chance: more than max({BASELINE_SPREAD_MULTIPLE:g} × the draws' sd, {EFFECT_FLOOR:g}) from their mean"
)
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
class NextTokenEffect:
    """A causal LM's next-token change under the ablation (unrounded; tokens as decoded text)."""

    kl_last: float  # KL(P_clean ‖ P_ablated) at the last position, nats
    kl_mean: float  # the same averaged over positions
    peak_position: int  # the position with the largest KL
    peak_token: str
    kl_peak: float
    top_clean: str  # most likely next token after the text, clean model
    top_ablated: str  # the same with the heads ablated
    top_change: str  # same / tie / flip (analysis.ablation.top_token_change; two ids can decode alike)
    p_clean: float  # the clean top token's probability, clean model
    p_ablated: float  # ... and with the heads ablated
    p_new: float  # the ablated top token's probability with the heads ablated
    loss_clean: float | None  # mean next-token loss on the text (None: a single token)
    loss_ablated: float | None

    @property
    def loss_change(self) -> float | None:
        """loss_ablated − loss_clean (> 0: the heads helped predict the text)."""
        if self.loss_clean is None or self.loss_ablated is None:
            return None
        return self.loss_ablated - self.loss_clean


@dataclass(frozen=True)
class EmbeddingEffect:
    """An encoder's output change under the ablation, as 1 − cos (unrounded)."""

    pooled: float  # between the mean-pooled embeddings
    mean: float  # per token, averaged
    peak_position: int  # the token that turned most
    peak_token: str
    peak: float


def heads_shown(heads: Sequence[str]) -> str:
    """The first eight labels, then how many more."""
    return ", ".join(heads[:8]) + (f" and {len(heads) - 8} more" if len(heads) > 8 else "")


def next_token_findings(largest: Sequence[PositionEffect]) -> list[Finding]:
    """The three positions whose next-token distribution moved most."""
    return [
        Finding(
            kind="next_token_kl",
            position=p.position,
            token=p.token,
            value=p.value,
            detail=f"at position {p.position} {p.token!r} the next-token distribution moves by KL {p.value:.4g}",
        )
        for p in largest[:3]
    ]


def _size_words(direction: str) -> str:
    return {"raises": "beyond chance", "lowers": "beyond chance", "within": "within chance"}.get(direction, direction)


def _baseline_words(baseline: AblationBaseline | None, unit: str) -> str:
    if baseline is None:
        return " (no random-head baseline: see notes)"
    sets = "heads" if baseline.heads_per_draw == 1 else f"sets of {baseline.heads_per_draw} heads"
    mean, sd = baseline.effect
    return f"; {baseline.draws} random {sets}: {mean:+.4f} ± {sd:.4f}{unit} — {_size_words(baseline.effect_direction)}"


def _top_text(effect: NextTokenEffect) -> str:
    if effect.top_change == "same":
        return f"the top next token stays {effect.top_clean!r} (p {effect.p_clean:.3f} -> {effect.p_ablated:.3f})"
    if effect.top_change == "tie":
        return (
            f"the top next token becomes a tie, not a flip: {effect.top_ablated!r} p {effect.p_new:.3f} vs "
            f"{effect.top_clean!r} {effect.p_ablated:.3f} under the ablation (within the {TIE_MARGIN} margin)"
        )
    return (
        f"the top next token flips from {effect.top_clean!r} to {effect.top_ablated!r} (p {effect.p_new:.3f} vs "
        f"{effect.p_ablated:.3f} under the ablation)"
    )


def next_token_summary(ablated: Ablated, effect: NextTokenEffect, baseline: AblationBaseline | None) -> str:
    """The loss change in words against random heads, the KL against theirs, where it peaks, the top next token."""
    who = f"Removing {heads_shown(ablated.heads)} ({ablated.how}) on {ablated.tokens} tokens"
    if effect.loss_change is not None and effect.loss_clean is not None and effect.loss_ablated is not None:
        way = "raises" if effect.loss_change > 0 else "lowers" if effect.loss_change < 0 else "leaves"
        loss = (
            f"{who} {way} the loss on the text by {abs(effect.loss_change):.4f} nats ({effect.loss_clean:.4f} -> "
            f"{effect.loss_ablated:.4f}){_baseline_words(baseline, ' nats')}."
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
    return (
        f"{loss} KL of the next-token distribution {effect.kl_mean:.4g} nats on average{kl_base}, "
        f"{effect.kl_last:.4g} at the last position (largest {effect.kl_peak:.4g} at position "
        f"{effect.peak_position} {effect.peak_token!r}); {_top_text(effect)}."
    )


def embedding_baseline_text(baseline: AblationBaseline | None) -> str:
    """The pooled embedding change against random heads'."""
    if baseline is None:
        return " No random-head baseline (see notes)."
    sets = "heads" if baseline.heads_per_draw == 1 else f"sets of {baseline.heads_per_draw} heads"
    mean, sd = baseline.effect
    word = {"raises": "larger than", "lowers": "smaller than", "within": "within the range of"}
    return (
        f" {baseline.draws} random {sets} turn it by {mean:.4g} ± {sd:.4g}: "
        f"{word.get(baseline.effect_direction, 'within the range of')} random heads."
    )


def embedding_findings(largest: Sequence[PositionEffect]) -> list[Finding]:
    """The three tokens whose output embedding turned most."""
    return [
        Finding(
            kind="embedding_change",
            position=p.position,
            token=p.token,
            value=p.value,
            detail=f"token {p.position} {p.token!r}'s output embedding turns by 1 − cos = {p.value:.4g}",
        )
        for p in largest[:3]
    ]


def embedding_summary(ablated: Ablated, effect: EmbeddingEffect) -> str:
    """How far the pooled embedding turns, per token on average, and which token turned most."""
    return (
        f"Removing {heads_shown(ablated.heads)} ({ablated.how}) on {ablated.tokens} tokens turns the mean-pooled "
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
        f"the ablated heads write {ablated:+.3f} into it ({each}); the largest writer is L{top.layer}H{top.head} "
        f"{top.logit:+.3f}."
    )


def dla_finding(dla: DirectLogitAttribution) -> Finding:
    top = dla.top_heads[0]
    return Finding(
        kind="direct_logit_attribution",
        layer=top.layer,
        head=top.head,
        value=top.logit,
        detail=f"L{top.layer}H{top.head} writes {top.logit:+.3f} directly into the logit of {dla.token!r} (final "
        f"{dla.final_norm} scale frozen); all heads together {dla.heads_total:+.3f} of {dla.logit:.3f}",
    )
