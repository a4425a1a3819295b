"""A traced prompt's numbers as report rows: the :class:`~.models.MeasuredTrace` both prompt tools embed.

Every row restates numbers the pass (:mod:`.measure`) and the checks (:mod:`.evidence`) measured, decoded into
tokens and segment names: each segment's shares and check results, the generated tokens, the answer the checks
measured and its deciding token, the filler set apart. No words here: ``trace_prompt_attention`` writes them.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from agent_tools.analysis.segments import leading_segment, top_positions
from agent_tools.encoding import decode
from agent_tools.loading import LoadedModel
from agent_tools.prompt_segments import Segment
from agent_tools.schemas import KeyWeight
from agent_tools.segment_attribution import causal_attribution
from agent_tools.traced_prompt.answer import covers
from agent_tools.traced_prompt.evidence import Evidence, Verdict, direction
from agent_tools.traced_prompt.measure import TracedPrompt, TraceNumbers
from agent_tools.traced_prompt.models import (
    AnswerEvidence,
    AnswerStop,
    AnswerToken,
    CausalEffect,
    DecidingToken,
    FillerToken,
    GeneratedToken,
    GradientAttribution,
    GradientRun,
    MeasuredTrace,
    RankAgreement,
    SegmentEffect,
    SegmentShare,
    TokenProbability,
    TokenShare,
)

NEXT_TOKENS_SHOWN = 5
TEXT_SHOWN = 80  # characters of a segment's text in the report
TOKEN_SHARES_SHOWN = 16  # tokens listed per segment in token_shares


def measured_trace(
    loaded: LoadedModel,
    traced: TracedPrompt,
    numbers: TraceNumbers,
    evidence: Evidence,
    checked: Verdict,
    *,
    top_k: int,
    sink_threshold: float,
    answer_stop: AnswerStop,
    max_new_tokens: int,
    neutral_id: int | None = None,
) -> MeasuredTrace:
    """The :class:`MeasuredTrace` of one traced pass (and of the checks that ran on it)."""
    prompt, names = traced.prompt, traced.prompt.names
    length, logits, generation = traced.prompt.encoded.length, traced.answer_logits, traced.generation
    generated = _generated_rows(loaded, traced, numbers) if traced.target == "generate" else None
    text = decode(loaded, traced.generated_ids, skip_special_tokens=True) if generated is not None else None
    sink, lead = prompt.index("sink"), numbers.lead
    return MeasuredTrace(
        target=traced.target,
        prompt_format=prompt.prompt_format,
        num_tokens=length,
        answer_position=length - 1,
        segments=[
            _segment_row(loaded, traced, numbers, evidence, i, top_k=top_k, deciding=checked.deciding)
            for i in range(len(prompt.segments))
        ],
        sink_positions=list(prompt.segments[sink].positions) if sink is not None else [],
        sink_threshold=sink_threshold,
        read_most=names[lead.best],
        runner_up=names[lead.runner_up] if lead.runner_up is not None else None,
        margin=lead.margin,
        next_tokens=_next_tokens(loaded, logits) if logits is not None else None,
        generated_text=text,
        generated=generated,
        answer_stop=answer_stop if traced.target == "generate" else None,
        stopped=generation.stopped if generation is not None else None,
        seconds_per_token=s if generation is not None and (s := generation.seconds_per_token) else None,
        neutral_token=decode(loaded, [neutral_id]) if neutral_id is not None else None,
        **_evidence_fields(loaded, traced, numbers, evidence, checked, max_new_tokens),
    )


def _deciding_token(
    traced: TracedPrompt, evidence: Evidence, checked: Verdict, answer: AnswerEvidence | None
) -> DecidingToken | None:
    step = checked.deciding
    if step is None or answer is None or evidence.clean is None:
        return None
    names = traced.prompt.names
    ranked = sorted(checked.checked, key=lambda i: -abs(evidence.causal[i].on_token(step)))
    return DecidingToken(
        step=step,
        token=answer.tokens[step],
        logprob=float(evidence.clean[step]),
        effects=[
            SegmentEffect(
                segment=names[i],
                removed=evidence.causal[i].on_token(step),
                direction=direction(evidence.causal[i].on_token(step)),
            )
            for i in ranked
        ],
    )


def _evidence_fields(
    loaded: LoadedModel,
    traced: TracedPrompt,
    numbers: TraceNumbers,
    evidence: Evidence,
    checked: Verdict,
    max_new_tokens: int,
) -> dict[str, Any]:
    """The trace-level evidence: the answer measured, the verdict, the agreement, the filler."""
    names = traced.prompt.names
    depends, against = checked.depends_on, checked.works_against
    answer = _answer_evidence(loaded, traced, evidence, checked, max_new_tokens)
    return {
        "checks": list(evidence.checks),
        "answer_evidence": answer,
        "deciding_token": _deciding_token(traced, evidence, checked, answer),
        "depends_on_most": names[depends[0]] if depends else None,
        "depends_on_runner_up": names[depends[1]] if len(depends) > 1 else None,
        "works_against_most": names[against[0]] if against else None,
        "moves_most": names[checked.moves_most] if checked.moves_most is not None else None,
        "agreement": [
            RankAgreement(measure_a=a, measure_b=b, spearman=rho, same_top=same)
            for a, b, rho, same in checked.agreement
        ],
        "measures_agree": checked.agree,
        "filler": _filler_rows(traced, numbers),
        "gradient_run": _gradient_run(evidence),
        "evidence_notes": list(evidence.notes),
        "causal_attribution": causal_attribution(*evidence.attribution, names) if evidence.attribution else None,
    }


def _answer_evidence(
    loaded: LoadedModel, traced: TracedPrompt, evidence: Evidence, checked: Verdict, max_new_tokens: int
) -> AnswerEvidence | None:
    """The answer the checks measured (when they measured one), decoded, what it covers in words, and per token
    the named segment whose removal moves it most."""
    if not evidence.answer_ids or evidence.clean is None:
        return None
    names, tokens = traced.prompt.names, [decode(loaded, [i]) for i in evidence.answer_ids]
    per_token = []
    for step, token in enumerate(tokens):
        mover = max(checked.checked, key=lambda i: abs(evidence.causal[i].on_token(step)), default=None)
        mover = mover if evidence.causal and mover is not None else None
        per_token.append(
            AnswerToken(
                step=step,
                token=token,
                logprob=float(evidence.clean[step]),
                moved_most_by=names[mover] if mover is not None else None,
                removed=evidence.causal[mover].on_token(step) if mover is not None else None,
            )
        )
    return AnswerEvidence(
        text=decode(loaded, evidence.answer_ids),
        token_ids=list(evidence.answer_ids),
        tokens=tokens,
        source="given" if evidence.source == "given" else "model",
        covers=covers(traced, evidence.source, tokens, max_new_tokens),
        logprob=float(evidence.clean.sum()),
        first_token_logprob=float(evidence.clean[0]),
        per_token=per_token,
    )


def _gradient_run(evidence: Evidence) -> GradientRun | None:
    if evidence.gradient is None:
        return None
    run = evidence.gradient.run
    change = run.value - run.baseline_value
    return GradientRun(
        steps=run.steps,
        baseline="every content token replaced by the neutral token",
        value=run.value,
        baseline_value=run.baseline_value,
        delta=run.delta,
        relative_delta=abs(run.delta) / abs(change) if change != 0 else 0.0,
    )


def _filler_rows(traced: TracedPrompt, numbers: TraceNumbers) -> list[FillerToken]:
    if numbers.filler_ratio is None or numbers.relative_norms is None:
        return []
    tokens, names = traced.prompt.encoded.tokens, traced.prompt.names
    return [
        FillerToken(
            position=p,
            token=tokens[p].text,
            segment=names[traced.prompt.token_segment[p]],
            received_ratio=float(numbers.filler_ratio[p]),
            relative_value_norm=float(numbers.relative_norms[p]),
            share=float(numbers.token_weights[p]),
        )
        for p in numbers.filler
    ]


def _next_tokens(loaded: LoadedModel, logits: Tensor) -> list[TokenProbability]:
    """The :data:`NEXT_TOKENS_SHOWN` most likely next tokens of (V,) logits, decoded."""
    probabilities = torch.softmax(logits.double(), -1)
    values, indices = probabilities.topk(NEXT_TOKENS_SHOWN)
    return [
        TokenProbability(token=decode(loaded, [int(i)]), token_id=int(i), probability=v)
        for v, i in zip(values.tolist(), indices.tolist(), strict=True)
    ]


def _short(text: str, limit: int = TEXT_SHOWN) -> str:
    text = text.replace("\n", "⏎")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _token_text(loaded: LoadedModel, traced: TracedPrompt, position: int) -> str:
    """A key's text: a prompt token's, or the decoded token the model wrote at that position."""
    tokens = traced.prompt.encoded.tokens
    if position < len(tokens):
        return tokens[position].text
    return decode(loaded, [traced.generated_ids[position - len(tokens)]])


def _segment_positions(traced: TracedPrompt, segment: Segment) -> list[int]:
    """The segment's key positions; for ``generated``, every generated token but the last (the keys written)."""
    if segment.kind == "generated":
        length = traced.prompt.encoded.length
        return list(range(length, length + max(len(traced.generated_ids) - 1, 0)))
    return list(segment.positions)


def _top_tokens(
    loaded: LoadedModel, traced: TracedPrompt, numbers: TraceNumbers, positions: list[int], top_k: int
) -> list[KeyWeight]:
    """The segment's most-read tokens: content tokens (filler set aside) unless the segment holds only filler."""
    token_weights = numbers.token_weights  # (Tk,)
    readable = [p for p in positions if p < token_weights.shape[0]]
    filler = set(numbers.filler) if numbers.exclude_filler else set()
    content = [p for p in readable if p not in filler] or readable
    top = top_positions(token_weights, content, top_k)
    return [KeyWeight(position=p, token=_token_text(loaded, traced, p), weight=w) for p, w in top]


def _token_shares(
    loaded: LoadedModel, traced: TracedPrompt, numbers: TraceNumbers, positions: list[int]
) -> list[TokenShare]:
    """Up to :data:`TOKEN_SHARES_SHOWN` of the segment's most-read tokens, filler included and flagged."""
    weights, values = numbers.token_weights, numbers.value_token_weights
    readable = [p for p in positions if p < weights.shape[0]]
    filler = set(numbers.filler)
    return [
        TokenShare(
            position=p,
            token=_token_text(loaded, traced, p),
            share=w,
            value_share=float(values[p]) if values is not None and p < values.shape[0] else None,
            filler=p in filler,
        )
        for p, w in top_positions(weights, readable, TOKEN_SHARES_SHOWN)
    ]


def _checks_of(evidence: Evidence, index: int, deciding: int | None) -> dict[str, Any]:
    """The segment's causal effect and gradient attribution, where the checks measured it."""
    fields: dict[str, Any] = {}
    causal = evidence.causal.get(index)
    if causal is not None:
        removed = causal.on_token(deciding)
        fields["causal"] = CausalEffect(removed=removed, direction=direction(removed), **asdict(causal))
    gradient = evidence.gradient
    if gradient is not None and index in gradient.integrated:
        fields["gradient"] = GradientAttribution(
            integrated_gradients=gradient.integrated[index],
            gradient_x_input=gradient.times_input[index],
        )
    return fields


def _segment_row(
    loaded: LoadedModel,
    traced: TracedPrompt,
    numbers: TraceNumbers,
    evidence: Evidence,
    index: int,
    *,
    top_k: int,
    deciding: int | None = None,
) -> SegmentShare:
    segment, views, sink = traced.prompt.segments[index], numbers.views, traced.prompt.index("sink")
    positions = _segment_positions(traced, segment)
    if segment.char_start is not None and segment.char_end is not None:
        text = traced.prompt.encoded.text[segment.char_start : segment.char_end]
    else:
        text = "".join(_token_text(loaded, traced, p) for p in positions)
    share = views["share"][index]
    no_rollout = segment.kind == "generated"
    value = views.get("value")
    return SegmentShare(
        name=segment.name,
        kind=segment.kind,
        tier=numbers.tiers[index],
        named_share=views["named"][index] if numbers.ranked[index] else None,
        message=segment.message,
        token_count=len(positions),
        positions=positions,
        text=_short(text),
        share=share,
        share_without_sink=None if index == sink else views["free"][index],
        share_per_token=share / len(positions) if positions else 0.0,
        last_layer_share=views["last"][index],
        rollout_share=None if no_rollout else views["rollout"][index],
        rollout_share_without_sink=None if no_rollout or index == sink else views["rollout_free"][index],
        top_tokens=_top_tokens(loaded, traced, numbers, positions, top_k),
        uniform_share=views["uniform"][index],
        content_share=None if index == sink else views["content"][index],
        filler_share=views["filler"][index],
        value_share=value[index] if value is not None else None,
        token_shares=_token_shares(loaded, traced, numbers, positions),
        **_checks_of(evidence, index, deciding),
    )


def _generated_rows(loaded: LoadedModel, traced: TracedPrompt, numbers: TraceNumbers) -> list[GeneratedToken]:
    """One row per generated token: the segment its attention read most, every share, the key read most, and the
    query position that chose it (an encoder–decoder's cross-attention: the decoder row, the answer's step)."""
    names, accumulator = traced.prompt.names, traced.shares
    first = 0 if traced.stack == "cross" else accumulator.prompt_length - 1  # cross: the answer's own decoder rows
    rows = []
    steps = zip(traced.generated_ids, accumulator.step_shares, accumulator.step_top_keys, strict=True)
    for step, (token_id, step_shares, (key, key_weight)) in enumerate(steps):
        step_lead = leading_segment(step_shares, numbers.ranked)
        rows.append(
            GeneratedToken(
                step=step,
                position=first + step,
                token=decode(loaded, [token_id]),
                token_id=token_id,
                read_most=names[step_lead.best],
                read_most_share=float(step_shares[step_lead.best]),
                shares=dict(zip(names, step_shares.tolist(), strict=True)),
                top_key=KeyWeight(position=key, token=_token_text(loaded, traced, key), weight=key_weight),
            )
        )
    return rows
