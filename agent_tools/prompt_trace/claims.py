"""The words for a trace's evidence: what the answer *depends on* (causal) before what it *reads* (attention).

Pure functions of numbers already measured (:mod:`.measure`, :mod:`.evidence`): the summary's leading sentence,
the filler clause, the findings of the checks, and the explanation of each view (mean share, last layer, rollout,
value-weighted share, causal effect, gradient) with the segment it puts first. Attention claims are worded
"reads" and name the uniform baseline; causal claims are worded "depends on".
"""

from __future__ import annotations

from agent_tools.prompt_trace.evidence import MEASURE_NAMES, Evidence, Verdict
from agent_tools.prompt_trace.measure import TracedPrompt, TraceNumbers
from agent_tools.prompt_trace.models import ViewLead
from agent_tools.schemas import Finding, rounded

FILLER_SHOWN = 5

VIEW_MEANINGS = {
    "share": "the answer position's attention summed per segment, mean over every layer and head: what it reads",
    "content": "the same with the sink and the filler tokens set aside (renormalised): what 'read most' ranks",
    "last_layer": "the last layer alone (mean over its heads): the reading closest to the output, not the whole path",
    "rollout": "attention rollout (Abnar & Zuidema 2020): head-averaged attention multiplied through the layers with "
    "the residual, sink set aside — how reading composes across layers, still not influence",
    "value": "attention weighted by what each key writes, ‖α·v·W_O‖ (Kobayashi et al. 2020): discounts tokens "
    "that are read but write little",
    "causal": "how much the answer's log-probability falls when the segment is removed or replaced by neutral "
    "tokens (mean of both): what the answer depends on",
    "gradient": "integrated gradients of the answer's log-probability w.r.t. the segment's input embeddings, from "
    "neutral tokens: a first-order account of the dependence",
}


def _name(traced: TracedPrompt, index: int) -> str:
    return traced.prompt.names[index]


def _rho(verdict: Verdict, a: str, b: str) -> float | None:
    return next((rho for x, y, rho, _ in verdict.agreement if {x, y} == {a, b}), None)


def causal_lead(traced: TracedPrompt, numbers: TraceNumbers, evidence: Evidence, verdict: Verdict, answer: str) -> str:
    """The summary's first sentences: what the answer depends on, then whether attention agrees."""
    if not verdict.depends_on:
        return ""
    best = verdict.depends_on[0]
    effect = evidence.causal[best]
    text = (
        f"The answer {answer!r} depends most on {_name(traced, best)!r}: removing it changes its log-probability by "
        f"{effect.answer_removed:+.2f} nats, replacing it with neutral tokens by {effect.answer_neutral:+.2f}"
    )
    if len(verdict.depends_on) > 1:
        second = verdict.depends_on[1]
        text += f" (next: {_name(traced, second)!r}, {evidence.causal[second].effect:.2f} nats)"
    return text + "." + _agreement_clause(traced, numbers, evidence, verdict) + " "


def _agreement_clause(traced: TracedPrompt, numbers: TraceNumbers, evidence: Evidence, verdict: Verdict) -> str:
    best, read = verdict.depends_on[0], verdict.read_first
    if read is None:
        return ""
    view = "content" if numbers.exclude_filler else "share"
    share, uniform = numbers.views[view][read], numbers.views["uniform"][read]
    if read == best:
        return (
            f" Attention agrees: the answer reads {_name(traced, read)!r} most ({share:.1%} of its attention; "
            f"uniform attention would give {uniform:.1%})."
        )
    rho = _rho(verdict, "attention", "causal")
    rank = f"; rank agreement attention–causal ρ = {rho:.2f}" if rho is not None else ""
    return (
        f" Attention disagrees: the answer reads {_name(traced, read)!r} most ({share:.1%}; uniform "
        f"{uniform:.1%}), yet depends on it by only {evidence.causal[read].effect:.2f} nats{rank}. The segment "
        f"that matters is {_name(traced, best)!r}."
    )


def filler_clause(traced: TracedPrompt, numbers: TraceNumbers) -> str:
    """Which filler / secondary-sink tokens were set apart, and how much of the attention they took."""
    if not numbers.filler:
        return ""
    tokens = traced.prompt.encoded.tokens
    shown = ", ".join(f"{tokens[p].text!r} ({p})" for p in numbers.filler[:FILLER_SHOWN])
    more = f" and {len(numbers.filler) - FILLER_SHOWN} more" if len(numbers.filler) > FILLER_SHOWN else ""
    taken = sum(numbers.views["filler"])
    verb = "set apart from" if numbers.exclude_filler else "counted in"
    return f" Filler / secondary sinks {verb} 'read most': {shown}{more}, {taken:.1%} of the attention."


def evidence_findings(
    traced: TracedPrompt, numbers: TraceNumbers, evidence: Evidence, verdict: Verdict
) -> list[Finding]:
    """Findings of the checks: the segment depended on, a disagreement with attention, the filler, agreement."""
    findings: list[Finding] = []
    if verdict.depends_on:
        best = verdict.depends_on[0]
        effect = evidence.causal[best]
        findings.append(
            Finding(
                kind="depends_on",
                value=rounded(effect.effect),
                detail=f"the answer depends most on {_name(traced, best)!r}: Δ log p {effect.answer_removed:+.3f} nats "
                f"removed, {effect.answer_neutral:+.3f} replaced by neutral tokens",
            )
        )
        read = verdict.read_first
        if read is not None and read != best:
            findings.append(
                Finding(
                    kind="attention_vs_causal",
                    value=rounded(evidence.causal[read].effect),
                    detail=f"attention misleads here: {_name(traced, read)!r} is read most but the answer depends on "
                    f"it by {evidence.causal[read].effect:.3f} nats, on {_name(traced, best)!r} by {effect.effect:.3f}",
                )
            )
    if numbers.filler:
        findings.append(
            Finding(
                kind="filler",
                value=rounded(sum(numbers.views["filler"])),
                detail=filler_clause(traced, numbers).strip(),
            )
        )
    for a, b, rho, same in verdict.agreement:
        if rho is not None:
            findings.append(
                Finding(
                    kind="rank_agreement",
                    value=rounded(rho),
                    detail=f"{MEASURE_NAMES[a]} vs {MEASURE_NAMES[b]}: Spearman ρ = {rho:.2f} over "
                    f"{len(verdict.segments)} segments" + ("; same segment first" if same else "; different first"),
                )
            )
    return findings


def view_leads(traced: TracedPrompt, numbers: TraceNumbers, evidence: Evidence, verdict: Verdict) -> list[ViewLead]:
    """Every view, what it measures, and the content segment it puts first."""
    views = numbers.views
    rows = [
        ViewLead(view="share", measures=VIEW_MEANINGS["share"], leader=_name(traced, numbers.lead.best), value=None),
        ViewLead(
            view="last_layer",
            measures=VIEW_MEANINGS["last_layer"],
            leader=_name(traced, numbers.last_lead.best),
            value=rounded(views["last"][numbers.last_lead.best]),
        ),
        ViewLead(
            view="rollout",
            measures=VIEW_MEANINGS["rollout"],
            leader=_name(traced, numbers.rollout_lead.best),
            value=rounded(views["rollout_free"][numbers.rollout_lead.best]),
        ),
    ]
    rows[0].value = rounded(views["content" if numbers.exclude_filler else "share"][numbers.lead.best])
    for name in ("value", "causal", "gradient"):
        values = verdict.measures.get(name)
        if values:
            best = max(range(len(values)), key=lambda i: values[i])
            rows.append(
                ViewLead(
                    view=name,
                    measures=VIEW_MEANINGS[name],
                    leader=_name(traced, verdict.segments[best]),
                    value=rounded(values[best]),
                )
            )
    return rows
