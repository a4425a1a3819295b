"""show_attention's words: the most-read key and the summary, written from numbers the plan has computed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent_tools.schemas import Finding, NextCall, head_label, rounded, text_follow_up
from agent_tools.tools.show_attention.models import AttentionView, QueryRow, ShowAttentionInput
from agent_tools.wording import head_name

SINK_SHARE = 0.1  # a sink's mean share of the other queries' attention (trace_prompt_attention's default too)
QUERY_LINES = 16  # texts of at most this many queries get one line per query (their top keys)


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
    sinks: tuple[tuple[int, str, float], ...] = ()  # (position, token, mean share over its readers), largest first


def most_read_finding(view: HeadView) -> Finding:
    """The key the head reads most, on average over its queries."""
    return Finding(
        kind="most_read_key",
        layer=view.layer,
        head=view.head,
        position=view.top_key,
        token=view.top_token,
        value=rounded(view.top_share),
        detail=f"{head_name(view.layer, view.head)} gives token {view.top_key} {view.top_token!r} "
        f"{view.top_share:.1%} of its attention on average",
    )


def _keys_text(keys: Sequence[tuple[int, str, float]]) -> str:
    return ", ".join(f"{position} {token!r} {share:.1%}" for position, token, share in keys)


def sink_finding(view: HeadView) -> Finding | None:
    """The special tokens (and the first token) that take sink-like attention: read by the other queries at a
    mean share of at least SINK_SHARE and at least twice what uniform attention would give them."""
    if not view.sinks:
        return None
    share = sum(s for _, _, s in view.sinks)
    first = view.sinks[0]
    return Finding(
        kind="sink",
        severity="high",
        layer=view.layer,
        head=view.head,
        position=first[0],
        token=first[1],
        value=rounded(share),
        detail=f"{head_name(view.layer, view.head)} parks attention on {_keys_text(view.sinks)} (mean share over the "
        f"other queries, each ≥ {SINK_SHARE:.0%} and ≥ 2× uniform)",
    )


def query_findings(rows: list[QueryRow]) -> list[Finding]:
    """Each query's top keys, one low-severity line each (the concise text keeps them when they fit)."""
    return [
        Finding(
            kind="query_top_keys",
            severity="low",
            position=r.position,
            token=r.token,
            value=rounded(r.top_keys[0].weight) if r.top_keys else None,
            detail=f"query {r.position} {r.token!r} reads "
            + _keys_text([(k.position, k.token, k.weight) for k in r.top_keys]),
        )
        for r in rows
    ]


def summary(view: HeadView) -> str:
    """How spread the head is and what it reads most, in one sentence; the sinks, when there are any, in another."""
    text = (
        f"Layer {view.layer} head {view.head} on {view.length} tokens: mean entropy {view.mean_entropy:.3f} nats "
        f"({view.mean_normalised_entropy:.0%} of uniform); it reads token {view.top_key} {view.top_token!r} most "
        f"({view.top_share:.1%} of attention on average)."
    )
    if view.sinks:
        names = " and ".join(f"{p} {t!r}" for p, t, _ in view.sinks[:3])
        text += (
            f" {names} {'are sinks' if len(view.sinks) > 1 else 'is a sink'}: read at ≥ 2× uniform, whatever the query."
        )
    return text


def next_calls(args: ShowAttentionInput, report: AttentionView) -> list[NextCall]:
    """Does this head matter, is its layer collapsed, and which ingredient makes it read what it reads."""
    name = head_name(report.layer, report.head)
    return [
        text_follow_up(
            args,
            "ablate_heads",
            {"heads": [head_label(report.layer, report.head)]},
            f"whether {name}'s reading matters for the output",
        ),
        text_follow_up(
            args,
            "diagnose_collapse",
            {"layers": [report.layer]},
            f"which heads of layer {report.layer} collapse, and whether harmlessly",
        ),
        text_follow_up(
            args,
            "reconstruct_attention",
            {"layer": report.layer, "head": report.head},
            "which step (scale, projections, positions, mask) makes it read that token",
        ),
    ]
