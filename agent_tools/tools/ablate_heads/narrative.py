"""ablate_heads' words: the summary and findings, written from the effect sizes the plan measured."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent_tools.schemas import Finding
from agent_tools.tools.ablate_heads.models import DirectLogitAttribution, PositionEffect


@dataclass(frozen=True)
class Ablated:
    """What was removed, from how long a text."""

    heads: Sequence[str]  # "L.H" labels
    method: str
    tokens: int


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
    top_changed: bool  # the top token ids differ (two ids can decode alike)
    p_clean: float  # the clean top token's probability, clean model
    p_ablated: float  # ... and with the heads ablated
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


def next_token_summary(ablated: Ablated, effect: NextTokenEffect) -> str:
    """KL at the last position and on average, where it peaks, the top next token, and the loss on the text."""
    loss_text = ""
    if effect.loss_change is not None:
        loss_text = (
            f" Loss on the text goes from {effect.loss_clean:.4f} to {effect.loss_ablated:.4f} nats "
            f"({effect.loss_change:+.4f})."
        )
    top_text = (
        f"the top next token changes from {effect.top_clean!r} to {effect.top_ablated!r}"
        if effect.top_changed
        else f"the top next token stays {effect.top_clean!r} (p {effect.p_clean:.3f} -> {effect.p_ablated:.3f})"
    )
    return (
        f"Ablating {heads_shown(ablated.heads)} ({ablated.method}) on {ablated.tokens} tokens: KL of the next-token "
        f"distribution {effect.kl_last:.4g} nats at the last position, {effect.kl_mean:.4g} on average (largest "
        f"{effect.kl_peak:.4g} at position {effect.peak_position} {effect.peak_token!r}); {top_text}.{loss_text}"
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
        f"Ablating {heads_shown(ablated.heads)} ({ablated.method}) on {ablated.tokens} tokens turns the mean-pooled "
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
