"""The words for a trace's evidence: what the answer *depends on* (removal) before what it *reads* (attention).

Pure functions of numbers the shared pass already measured (:mod:`agent_tools.traced_prompt`'s ``measure`` and
``evidence``). One sign convention: every causal number is Δ log p(answer) when the segment is removed, and every
sentence says which way it goes — "the answer depends on X (removing it lowers log p by 3.9)" or "X works against
this answer (removing it raises log p by 1.5)".
Rankings and the headline are over the named segments; gaps and template-inserted text are reported apart.
Attention claims are worded "reads" and print the one share they are ranked by; gradients are described as an
approximation of removal, with their agreement, never as a confirmation.
"""

from __future__ import annotations

from agent_tools.schemas import Finding
from agent_tools.tools.trace_prompt_attention.models import ViewLead
from agent_tools.traced_prompt.evidence import MEASURE_NAMES, Evidence, Verdict, direction
from agent_tools.traced_prompt.measure import TracedPrompt, TraceNumbers
from agent_tools.traced_prompt.models import AGREEMENT_RHO, NEGLIGIBLE_NATS, AnswerEvidence
from agent_tools.traced_prompt.run import TraceRun
from agent_tools.wording import listed

FILLER_SHOWN = 5
SUPPORTERS_SHOWN = 2

VIEW_MEANINGS = {
    "share": "the answer's attention on the named segments (sink, filler, template and gaps set aside, "
    "renormalised), mean over every layer and head: what it reads",
    "last_layer": "the last layer alone (mean over its heads): the reading closest to the output, not the whole path",
    "rollout": "attention rollout (Abnar & Zuidema 2020): head-averaged attention multiplied through the layers with "
    "the residual, sink set aside — how reading composes across layers, still not influence",
    "value": "attention weighted by what each key writes, ‖α·v·W_O‖ (Kobayashi et al. 2020): discounts tokens "
    "that are read but write little",
    "causal": "Δ log p of the deciding token when the segment is removed (negative: the answer depends on it; "
    "positive: it works against the answer); the leader has the largest |Δ|",
    "gradient": "integrated gradients of the whole answer's log p w.r.t. the segment's input embeddings, from "
    "neutral tokens: an approximation of removal, with its agreement reported per prompt",
}


def _name(traced: TracedPrompt, index: int) -> str:
    return traced.prompt.names[index]


def _agreement(verdict: Verdict, a: str, b: str) -> tuple[float | None, bool]:
    """How measures ``a`` and ``b`` agree: their rank correlation (None: undefined) and whether they put the same
    segment first."""
    return next(((rho, same) for x, y, rho, same in verdict.agreement if (x, y) == (a, b)), (None, False))


def effect_words(name: str, delta: float, *, of: str = "log p") -> str:
    """One segment's removal effect in words, the direction named: 'depends on', 'works against' or barely moves."""
    kind = direction(delta)
    if kind == "negligible":
        return f"barely moves without {name!r} ({delta:+.2f}, under {NEGLIGIBLE_NATS} nats)"
    verb = "depends on" if kind == "depends_on" else "is pulled against by"
    return f"{verb} {name!r} ({removal_words(delta, of=of)})"


def _deciding_text(answer: AnswerEvidence | None, step: int | None) -> str:
    """The deciding token's text (the whole answer's when there is no such step)."""
    if answer is None:
        return ""
    return answer.tokens[step] if step is not None and step < len(answer.tokens) else answer.text


def _token_clauses(traced: TracedPrompt, evidence: Evidence, verdict: Verdict) -> str:
    step = verdict.deciding
    supporters = [
        effect_words(_name(traced, i), evidence.causal[i].on_token(step)) for i in verdict.depends_on[:SUPPORTERS_SHOWN]
    ]
    against = [effect_words(_name(traced, i), evidence.causal[i].on_token(step)) for i in verdict.works_against[:1]]
    supporters = supporters[:1] + [c.replace("depends on ", "on ", 1) for c in supporters[1:]]
    clauses = supporters + against
    if not clauses:
        return f"no named segment moves it by more than {NEGLIGIBLE_NATS} nats when removed"
    return " and ".join(clauses)


def causal_lead(run: TraceRun) -> str:
    """The summary's first sentences: the measured answer, its deciding token and the named segments that move
    it (direction named), the gaps and inserted text apart, then whether attention agrees."""
    traced, numbers, evidence, verdict = run.traced, run.numbers, run.evidence, run.verdict
    answer = run.measured.answer_evidence
    if verdict.deciding is None or answer is None:
        return ""
    step, tokens, token = verdict.deciding, answer.tokens, _deciding_text(answer, verdict.deciding)
    text = f"Measured answer {answer.text!r}: {answer.covers}. "
    if len(tokens) > 1:
        text += (
            f"Deciding token {token!r} (step {step} of {len(tokens)}, the one removals move most): it "
            f"{_token_clauses(traced, evidence, verdict)}."
        )
        whole = min(verdict.checked, key=lambda i: evidence.causal[i].answer_removed)
        delta = evidence.causal[whole].answer_removed
        if direction(delta) == "depends_on":
            text += f" The whole answer {effect_words(_name(traced, whole), delta, of='Σ log p')} most."
    else:
        text += f"{token!r} {_token_clauses(traced, evidence, verdict)}."
    return text + _apart_clause(traced, evidence, verdict) + _agreement_clause(traced, numbers, verdict)


def removal_words(delta: float, *, of: str = "log p") -> str:
    """'removing it lowers log p by X' / 'raises' / 'barely moves it': the sign said in words."""
    if direction(delta) == "depends_on":
        return f"removing it lowers {of} by {-delta:.2f}"
    if direction(delta) == "works_against":
        return f"removing it raises {of} by {delta:.2f}"
    return f"removing it barely moves {of} ({delta:+.2f})"


def _apart_clause(traced: TracedPrompt, evidence: Evidence, verdict: Verdict) -> str:
    """Gaps and inserted text: measured like the named segments but never the headline."""
    parts = []
    for i in verdict.apart:
        segment = traced.prompt.segments[i]
        delta = evidence.causal[i].on_token(verdict.deciding) if i in evidence.causal else None
        inserted = segment.kind == "inserted"  # always said: the model read text nobody sent
        if delta is None or (direction(delta) == "negligible" and not inserted):
            continue
        what = "inserted by the chat template" if inserted else "unnamed text between the named"
        parts.append(f"{segment.name!r} ({what}, {len(segment.positions)} tokens): {removal_words(delta)}")
    if not parts:
        return ""
    return " Reported apart: " + "; ".join(parts) + "."


def _exclusions(traced: TracedPrompt, numbers: TraceNumbers) -> str:
    kinds = {s.kind for s in traced.prompt.segments}
    left = []
    if "sink" in kinds:
        left.append("sink")
    if numbers.exclude_filler and numbers.filler:
        left.append("filler")
    if kinds & {"template", "special"}:
        left.append("template")
    if any(t in ("gap", "inserted") for t in numbers.tiers):
        left.append("gaps" if "inserted" not in numbers.tiers else "gaps and inserted text")
    return ", ".join(left) + " set aside" if left else "nothing set aside"


def reading_sentence(traced: TracedPrompt, numbers: TraceNumbers, *, prefix: str) -> str:
    """What attention reads most among the named segments, on the one share it is ranked by."""
    best, named, uniform = numbers.lead.best, numbers.views["named"], numbers.views["named_uniform"]
    runner_up = numbers.lead.runner_up
    if runner_up is None:  # one named segment: nothing to rank; its share of the content, the rest apart
        content = numbers.views["content" if numbers.exclude_filler else "free"]
        left = "sink and filler set aside" if numbers.exclude_filler and numbers.filler else "sink set aside"
        return (
            f"{prefix} reads {_name(traced, best)!r}, the only named segment, with {content[best]:.1%} of its "
            f"attention ({left}; uniform would give {numbers.views['uniform'][best]:.1%} of the prompt); name "
            "spans with segments to compare parts."
        )
    return (
        f"{prefix} reads {_name(traced, best)!r} most among the named segments: {named[best]:.1%} of the attention "
        f"on them ({_exclusions(traced, numbers)}; uniform would give {uniform[best]:.1%}), "
        f"{numbers.lead.margin * 100:.1f} points over {_name(traced, runner_up)!r} ({named[runner_up]:.1%})."
    )


def _agreement_clause(traced: TracedPrompt, numbers: TraceNumbers, verdict: Verdict) -> str:
    read, moves = verdict.read_first, verdict.moves_most
    if read is None or moves is None or len(verdict.segments) < 2:
        return ""
    text = " " + reading_sentence(traced, numbers, prefix="Attention")
    rho, _ = _agreement(verdict, "attention", "causal")
    order = f"ρ = {rho:.2f}" if rho is not None else "ρ undefined"
    count = len(verdict.segments)
    if verdict.agree:
        text += f" Attention and removal agree (same top segment, {order} ≥ {AGREEMENT_RHO} over {count} named)."
    else:
        ranking = sorted(verdict.segments, key=lambda i: -numbers.views["named"][i])
        place = ranking.index(moves) + 1
        text += (
            f" They disagree: removal moves {_name(traced, moves)!r} most, attention ranks it {place} of {count} "
            f"({order}; agreement needs the same top and ρ ≥ {AGREEMENT_RHO})."
        )
    if "gradient" in verdict.measures and "removal" in verdict.measures:
        gradient_rho, same = _agreement(verdict, "gradient", "removal")
        [(_, top, _)] = _measure_lead(verdict, "gradient")
        shown = f"ρ = {gradient_rho:.2f}" if gradient_rho is not None else "ρ undefined"
        text += (
            f" Integrated gradients (an approximation of removal, whole answer) put {_name(traced, top)!r} first, "
            + ("as removal does" if same else "unlike removal")
            + f" ({shown})."
        )
    return text


def filler_clause(traced: TracedPrompt, numbers: TraceNumbers) -> str:
    """Which filler / secondary-sink tokens were set apart, and how much of the attention they took."""
    if not numbers.filler:
        return ""
    tokens = traced.prompt.encoded.tokens
    shown = listed([f"{tokens[p].text!r} ({p})" for p in numbers.filler], FILLER_SHOWN)
    verb = "set apart from" if numbers.exclude_filler else "counted in"
    return f" Filler / secondary sinks {verb} 'read most': {shown}."


def evidence_findings(run: TraceRun) -> list[Finding]:
    """Findings of the checks: the deciding token's movers (each direction named), gaps and inserted text apart,
    the filler, and the rank agreements."""
    traced, numbers, evidence, verdict = run.traced, run.numbers, run.evidence, run.verdict
    findings: list[Finding] = []
    step = verdict.deciding
    token = _deciding_text(run.measured.answer_evidence, step)
    ranked = sorted(verdict.checked, key=lambda i: -abs(evidence.causal[i].on_token(step))) if evidence.causal else []
    for i in ranked[:3]:
        delta = evidence.causal[i].on_token(step)
        findings.append(
            Finding(
                kind=direction(delta),
                severity="high" if i == verdict.moves_most else "medium",
                value=delta,
                detail=f"{token!r} {effect_words(_name(traced, i), delta)}; whole answer Δ Σ log p "
                f"{evidence.causal[i].answer_removed:+.2f} removed, {evidence.causal[i].answer_neutral:+.2f} "
                "replaced by neutral tokens",
            )
        )
    for i in verdict.apart:
        if i not in evidence.causal:
            continue
        delta = evidence.causal[i].on_token(step)
        segment = traced.prompt.segments[i]
        what = "inserted by the chat template" if segment.kind == "inserted" else "the unnamed text between"
        findings.append(
            Finding(
                kind="gap" if segment.kind != "inserted" else "template_inserted",
                value=delta,
                detail=f"{segment.name!r} ({what}, reported apart): {token!r} {effect_words(segment.name, delta)}",
            )
        )
    if numbers.filler:
        findings.append(
            Finding(
                kind="filler",
                value=sum(numbers.views["filler"]),
                detail=filler_clause(traced, numbers).strip(),
            )
        )
    for a, b, rho, same in verdict.agreement:
        if rho is not None:
            findings.append(
                Finding(
                    kind="rank_agreement",
                    severity="low",
                    value=rho,
                    detail=f"{MEASURE_NAMES[a]} vs {MEASURE_NAMES[b]}: Spearman ρ = {rho:.2f} over "
                    f"{len(verdict.segments)} named segments" + ("; same first" if same else "; different first"),
                )
            )
    return findings


def view_leads(run: TraceRun) -> list[ViewLead]:
    """Every view, what it measures, and the segment it puts first (a check's view where the check ran)."""
    numbers, evidence, verdict = run.numbers, run.evidence, run.verdict
    views = (("share", "named", numbers.lead), ("last_layer", "last", numbers.last_lead))
    leads = [(view, lead.best, numbers.views[key][lead.best]) for view, key, lead in views]
    leads.append(("rollout", numbers.rollout_lead.best, numbers.views["rollout_free"][numbers.rollout_lead.best]))
    leads += _measure_lead(verdict, "value")
    if verdict.moves_most is not None:
        leads.append(("causal", verdict.moves_most, evidence.causal[verdict.moves_most].on_token(verdict.deciding)))
    leads += _measure_lead(verdict, "gradient")
    return [
        ViewLead(view=view, measures=VIEW_MEANINGS[view], leader=_name(run.traced, index), value=value)
        for view, index, value in leads
    ]


def _measure_lead(verdict: Verdict, view: str) -> list[tuple[str, int, float]]:
    """The named segment a ranking measure puts first and its value, as a one-row list (empty when that measure
    did not run)."""
    if view not in verdict.measures or not verdict.segments:
        return []
    values = verdict.measures[view]
    best = max(range(len(values)), key=lambda i: values[i])
    return [(view, verdict.segments[best], values[best])]
