"""compare_prompts' findings and summary: text written from the measured :class:`Comparison`."""

from __future__ import annotations

from dataclasses import dataclass

from agent_tools.schemas import Finding, rounded
from agent_tools.tools.compare_prompts.models import SegmentComparison
from agent_tools.traced_prompt.models import MeasuredTrace, TokenProbability

SHIFTS_SHOWN = 3


@dataclass(frozen=True)
class Comparison:
    """Two traced variants' numbers and what was measured between them: everything the narrative is written from."""

    a: MeasuredTrace
    b: MeasuredTrace
    rows: list[SegmentComparison]  # every segment of either variant, largest |change| first
    kl: float | None  # KL(A ‖ B) of the next-token distributions; None without a next-token head
    top_tokens: tuple[TokenProbability, TokenProbability] | None  # each variant's top next token, with kl
    same_top_token: bool | None  # whether those top tokens are the same token (None with kl None)
    generated: bool  # target 'generate': the variants' answers are compared
    first_difference: int | None  # first generated step where the answers differ (None: same)


def narrate(comparison: Comparison) -> tuple[str, list[Finding]]:
    """The summary and the findings of one comparison."""
    findings = [_share_shift(row) for row in comparison.rows[:SHIFTS_SHOWN]]
    inserted = _inserted_clause(comparison.a, comparison.b).strip()
    if inserted:
        findings.append(Finding(kind="template_inserted", detail=inserted))
    if comparison.kl is not None and comparison.top_tokens is not None:
        findings.append(_next_token_kl(comparison.kl, *comparison.top_tokens))
    if comparison.generated:
        findings.append(_generated(comparison))
    return _summary(comparison), findings


def _shown(share: float | None) -> str:
    return "absent" if share is None else f"{share:.1%}"


def _share_shift(row: SegmentComparison) -> Finding:
    return Finding(
        kind="share_shift",
        value=row.change,
        detail=f"{row.name!r}: {_shown(row.share_a)} -> {_shown(row.share_b)} ({row.change * 100:+.1f} points)",
    )


def _next_token_kl(kl: float, top_a: TokenProbability, top_b: TokenProbability) -> Finding:
    return Finding(
        kind="next_token_kl",
        value=rounded(kl),
        detail=f"next-token KL(A‖B) = {kl:.3f} nats; top token {top_a.token!r} ({top_a.probability:.1%}) -> "
        f"{top_b.token!r} ({top_b.probability:.1%})",
    )


def _generated(comparison: Comparison) -> Finding:
    a, b, first = comparison.a, comparison.b, comparison.first_difference
    return Finding(
        kind="generated",
        value=float(first) if first is not None else None,
        detail=f"A wrote {a.generated_text!r}, B wrote {b.generated_text!r}"
        + ("" if first is None else f" (first different token at step {first})"),
    )


def _depends(label: str, trace: MeasuredTrace) -> str:
    """What the variant's answer depends on, in words — never 'depends on None'."""
    if "causal" not in trace.checks:
        return f"{label}'s answer was not checked ({'; '.join(trace.evidence_notes) or 'no causal check'})"
    deciding = trace.deciding_token
    token = f"{deciding.token!r}" if deciding is not None else "its answer"
    if trace.depends_on_most is None:
        return f"{label}'s {token} depends on no named segment (removing none lowers its log p)"
    effect = next((e for e in deciding.effects if e.segment == trace.depends_on_most), None) if deciding else None
    size = f" (removing it lowers log p by {-effect.removed:.2f})" if effect is not None else ""
    return f"{label}'s {token} depends most on {trace.depends_on_most!r}{size}"


def _inserted_clause(a: MeasuredTrace, b: MeasuredTrace) -> str:
    """Say when a variant's chat template inserted text (e.g. a default system prompt) the other did not get."""
    inserted = {label: [s for s in t.segments if s.kind == "inserted"] for label, t in (("A", a), ("B", b))}
    parts = []
    for label, segments in inserted.items():
        if segments:
            shown = ", ".join(f"{s.text!r}" for s in segments[:2])
            parts.append(f"{label}'s chat template inserted {shown} ({sum(s.token_count for s in segments)} tokens)")
    if not parts:
        return ""
    if bool(inserted["A"]) != bool(inserted["B"]):
        parts[-1] += "; the other variant did not get it"
    return " " + "; ".join(parts) + "."


def _summary(comparison: Comparison) -> str:
    a, b, rows = comparison.a, comparison.b, comparison.rows
    biggest = rows[0]
    summary = (
        f"A reads {a.read_most!r} most, B reads {b.read_most!r} most. The largest shift is {biggest.name!r}: "
        f"{_shown(biggest.share_a)} -> {_shown(biggest.share_b)} ({biggest.change * 100:+.1f} points)"
    )
    if len(rows) > 1:
        summary += f", then {rows[1].name!r} ({rows[1].change * 100:+.1f} points)"
    summary += "."
    if "causal" in a.checks or "causal" in b.checks:
        summary += f" By removal, {_depends('A', a)}; {_depends('B', b)}."
    summary += _inserted_clause(a, b)
    if comparison.kl is not None and comparison.top_tokens is not None:
        top_a, top_b = comparison.top_tokens
        summary += f" Next-token KL(A‖B) = {comparison.kl:.3f} nats; top token {top_a.token!r} -> {top_b.token!r}."
    if comparison.generated:
        first = comparison.first_difference
        summary += f" Generated: A {a.generated_text!r}, B {b.generated_text!r}" + (
            " (identical)." if first is None else f" (differ from step {first})."
        )
    return summary
