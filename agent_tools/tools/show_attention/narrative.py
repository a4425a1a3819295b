"""show_attention's words: the most-read key and the summary, written from numbers the plan has computed."""

from __future__ import annotations

from dataclasses import dataclass

from agent_tools.schemas import Finding, NextCall, follow_up, rounded
from agent_tools.tools.show_attention.models import AttentionView, ShowAttentionInput


@dataclass(frozen=True)
class HeadView:
    """What one head's map came to, unrounded: its entropy and the key it gives most attention on average."""

    layer: int
    head: int
    length: int  # tokens
    mean_entropy: float  # nats
    mean_normalised_entropy: float  # share of uniform
    top_key: int  # the key with the largest mean weight over queries
    top_token: str
    top_share: float  # that key's mean weight


def most_read_finding(view: HeadView) -> Finding:
    """The key the head reads most, on average over its queries."""
    return Finding(
        kind="most_read_key",
        layer=view.layer,
        head=view.head,
        position=view.top_key,
        token=view.top_token,
        value=rounded(view.top_share),
        detail=f"L{view.layer}H{view.head} gives token {view.top_key} {view.top_token!r} "
        f"{view.top_share:.1%} of its attention on average",
    )


def summary(view: HeadView) -> str:
    """How spread the head is and what it reads most, in one sentence."""
    return (
        f"Layer {view.layer} head {view.head} on {view.length} tokens: mean entropy {view.mean_entropy:.3f} nats "
        f"({view.mean_normalised_entropy:.0%} of uniform); it reads token {view.top_key} {view.top_token!r} most "
        f"({view.top_share:.1%} of attention on average)."
    )


def next_calls(args: ShowAttentionInput, report: AttentionView) -> list[NextCall]:
    """Does this head matter, is its layer collapsed, and which ingredient makes it read what it reads."""
    label, where = f"{report.layer}.{report.head}", {"layer": report.layer, "head": report.head}
    return [
        follow_up(
            "ablate_heads",
            {"text": args.text, "heads": [label]},
            f"whether L{report.layer}H{report.head}'s reading matters for the output",
            model=args.model,
        ),
        follow_up(
            "diagnose_collapse",
            {"text": args.text, "layers": [report.layer]},
            f"which heads of layer {report.layer} collapse, and whether harmlessly",
            model=args.model,
        ),
        follow_up(
            "reconstruct_attention",
            {"text": args.text, **where},
            "which step (scale, projections, positions, mask) makes it read that token",
            model=args.model,
        ),
    ]
