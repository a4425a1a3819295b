"""trace_prompt_attention's findings and summary: text written from numbers the shared pass already computed
(:func:`agent_tools.traced_prompt.measure.measure`).

One function per finding kind; the summary is built from the same numbers, clause by clause. Nothing here
runs the model or decodes tokens: what the model answered arrives decoded, in the trace's rows
(:class:`~agent_tools.traced_prompt.models.MeasuredTrace`: the generated tokens, or the top next tokens).
"""

from __future__ import annotations

from collections import Counter

import torch

from agent_tools.schemas import Finding
from agent_tools.tools.trace_prompt_attention.claims import (
    causal_lead,
    evidence_findings,
    filler_clause,
    reading_sentence,
)
from agent_tools.traced_prompt.answer import STOP_WORDS
from agent_tools.traced_prompt.measure import TracedPrompt, TraceNumbers
from agent_tools.traced_prompt.models import GeneratedToken, MeasuredTrace
from agent_tools.traced_prompt.run import TraceRun
from agent_tools.wording import head_name

PEAKS_SHOWN = 3


def narrate(run: TraceRun) -> tuple[str, list[Finding]]:
    """The summary and the findings of one trace.

    The trace's rows (``run.measured``) say what the model answered (its generated tokens, or its top next
    tokens); when the checks ran, the causal sentences (:func:`.claims.causal_lead`: the measured answer, what its
    deciding token depends on, whether attention agrees) open the summary and their findings come first; the
    clause naming the filler set apart ends it.
    """
    traced, numbers, answer, lead = run.traced, run.numbers, run.measured, causal_lead(run)
    summary = lead + _reading_if_missing(traced, numbers, lead) if lead else _summary(traced, numbers, answer)
    return summary + filler_clause(traced, numbers), evidence_findings(run) + _findings(traced, numbers, answer)


# --- findings ----------------------------------------------------------------------------------------------------
def _findings(traced: TracedPrompt, numbers: TraceNumbers, answer: MeasuredTrace) -> list[Finding]:
    findings = [_read_most(traced, numbers)]
    if numbers.lead.runner_up is not None:
        findings.append(_runner_up(traced, numbers, numbers.lead.runner_up))
    sink = traced.prompt.index("sink")
    if sink is not None:
        findings.append(_sink(traced, numbers, sink))
    findings += [_top_head(traced, numbers), _last_layer(traced, numbers), _rollout(traced, numbers)]
    template = _winning_template(traced, numbers)
    if template is not None:
        findings.append(_template(traced, numbers, template))
    if answer.generated is not None:
        findings.append(_tokens_read_most(answer.generated))
        findings.extend(peak_findings(traced, numbers, answer.generated))
    return findings


def _best(traced: TracedPrompt, numbers: TraceNumbers) -> str:
    return traced.prompt.names[numbers.lead.best]


def _answer_position(traced: TracedPrompt) -> int:
    return traced.prompt.encoded.length - 1


def _read_most(traced: TracedPrompt, numbers: TraceNumbers) -> Finding:
    named, best = numbers.views["named"], numbers.lead.best
    answer = _answer_position(traced)
    reader = (
        "the answer"
        if traced.target == "generate"
        else f"position {answer} {traced.prompt.encoded.tokens[answer].text!r}"
    )
    return Finding(
        kind="read_most",
        severity="low",
        value=named[best],
        detail=f"{reader} reads {_best(traced, numbers)!r} most among the named segments: {named[best]:.1%} of the "
        f"attention on them (mean over {numbers.num_layers} layers × {numbers.num_heads} heads; uniform would give "
        f"{numbers.views['named_uniform'][best]:.1%})",
    )


def _runner_up(traced: TracedPrompt, numbers: TraceNumbers, runner_up: int) -> Finding:
    named = numbers.views["named"]
    return Finding(
        kind="runner_up",
        severity="low",
        value=named[runner_up],
        detail=f"next is {traced.prompt.names[runner_up]!r} with {named[runner_up]:.1%} of the attention on the "
        f"named segments, {numbers.lead.margin * 100:.1f} points less",
    )


def _sink(traced: TracedPrompt, numbers: TraceNumbers, sink: int) -> Finding:
    share, tokens = numbers.views["share"], traced.prompt.encoded.tokens
    positions = traced.prompt.segments[sink].positions
    listed = ", ".join(f"{p} {tokens[p].text!r}" for p in positions)
    return Finding(
        kind="sink",
        position=positions[0],
        token=tokens[positions[0]].text,
        value=share[sink],
        detail=f"the sink ({listed}) takes {share[sink]:.1%} of the attention; it is kept apart",
    )


def _top_head(traced: TracedPrompt, numbers: TraceNumbers) -> Finding:
    layer, head, value = numbers.top_head
    return Finding(
        kind="top_head",
        layer=layer,
        head=head,
        value=value,
        detail=f"{head_name(layer, head)} reads {_best(traced, numbers)!r} hardest: {value:.1%} of its attention",
    )


def _last_layer(traced: TracedPrompt, numbers: TraceNumbers) -> Finding:
    value = numbers.views["last"][numbers.last_lead.best]
    return Finding(
        kind="last_layer",
        layer=numbers.num_layers - 1,
        value=value,
        detail=f"in the last layer alone {traced.prompt.names[numbers.last_lead.best]!r} leads with {value:.1%}",
    )


def _rollout(traced: TracedPrompt, numbers: TraceNumbers) -> Finding:
    best = numbers.rollout_lead.best
    value, answer = numbers.views["rollout_free"][best], _answer_position(traced)
    return Finding(
        kind="rollout",
        position=answer,
        value=value,
        detail=f"by rollout at position {answer}, {traced.prompt.names[best]!r} leads with {value:.1%} once the sink "
        f"is set aside (raw {numbers.views['rollout'][best]:.2%})",
    )


def _winning_template(traced: TracedPrompt, numbers: TraceNumbers) -> int | None:
    """The template segment's index when its own tokens out-draw the segment read most, else None."""
    template = traced.prompt.index("template")
    share = numbers.views["share"]
    return template if template is not None and share[template] > share[numbers.lead.best] else None


def _template(traced: TracedPrompt, numbers: TraceNumbers, template: int) -> Finding:
    share = numbers.views["share"][template]
    return Finding(
        kind="template",
        value=share,
        detail=f"the chat template's own tokens take {share:.1%}, more than {_best(traced, numbers)!r}",
    )


def _tokens_read_most(generated: list[GeneratedToken]) -> Finding:
    favourite, times = Counter(item.read_most for item in generated).most_common(1)[0]  # ties: the first seen
    return Finding(
        kind="tokens_read_most",
        value=float(times),
        detail=f"{times} of {len(generated)} generated tokens read {favourite!r} most",
    )


def peak_findings(traced: TracedPrompt, numbers: TraceNumbers, generated: list[GeneratedToken]) -> list[Finding]:
    """Per content segment, the generated token that read it most, against its mean over the answer.

    Sorted by peak / mean, so a segment read in one burst (a value being copied) comes first; at most 3.
    """
    if len(generated) < 2:
        return []
    names = traced.prompt.names
    per_step = torch.stack(traced.shares.step_shares)  # (steps, S)
    mean = per_step.mean(0)  # (S,)
    peak_values, peak_steps = per_step.max(0)  # (S,) each
    rows = []
    for index in torch.nonzero(numbers.ranked).flatten().tolist():
        if mean[index] <= 0:
            continue
        step, value = int(peak_steps[index]), float(peak_values[index])
        ratio = value / float(mean[index])
        detail = (
            f"{names[index]!r} is read most while writing {generated[step].token!r} (step {step}): {value:.1%}, "
            f"{ratio:.1f}× its mean {float(mean[index]):.1%}"
        )
        rows.append((ratio, Finding(kind="peak", position=generated[step].position, value=value, detail=detail)))
    rows.sort(key=lambda row: -row[0])
    return [finding for _, finding in rows[:PEAKS_SHOWN]]


# --- summary -----------------------------------------------------------------------------------------------------
def _reading_if_missing(traced: TracedPrompt, numbers: TraceNumbers, lead: str) -> str:
    """With fewer than two named segments the causal lead says nothing of reading: say it here."""
    if "among the named segments" in lead:
        return ""
    return " " + reading_sentence(traced, numbers, prefix="Attention")


def _summary(traced: TracedPrompt, numbers: TraceNumbers, answer: MeasuredTrace) -> str:
    return reading_sentence(traced, numbers, prefix=_opening(traced, answer)) + _answer_clause(traced, numbers, answer)


def _opening(traced: TracedPrompt, answer: MeasuredTrace) -> str:
    if answer.generated is not None and traced.generation is not None:
        end = STOP_WORDS.get(traced.generation.stopped, traced.generation.stopped).split(" (")[0]
        return f"Generating {answer.generated_text!r} ({len(answer.generated)} tokens, stopped at {end}), the answer"
    if traced.stack == "cross":
        return "Choosing the first answer token, the decoder's cross-attention"
    position = _answer_position(traced)
    return f"At the last prompt position {position} {traced.prompt.encoded.tokens[position].text!r}, the model"


def _answer_clause(traced: TracedPrompt, numbers: TraceNumbers, answer: MeasuredTrace) -> str:
    if answer.generated:
        best = _best(traced, numbers)
        count = sum(1 for g in answer.generated if g.read_most == best)
        return f" {count} of {len(answer.generated)} generated tokens read {best!r} most (per-token peaks: findings)."
    if answer.next_tokens:
        top = answer.next_tokens[0]
        return f" Next token: {top.token!r} ({top.probability:.1%})."
    return ""
