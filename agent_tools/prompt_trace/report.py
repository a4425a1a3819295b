"""The prompt trace as a report: run the traced pass, measure it, decode the rows, and write the narrative.

:func:`trace` is what both prompt tools call: ``trace_prompt_attention`` returns its report, and
``compare_prompts`` traces two variants and compares the reports and their next-token logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from agent_tools.analysis.segments import leading_segment, top_positions
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel
from agent_tools.prompt_segments import Segment, SegmentSpec
from agent_tools.prompt_trace.measure import TracedPrompt, TraceNumbers, measure, trace_pass
from agent_tools.prompt_trace.models import (
    DEFAULT_SINK_THRESHOLD,
    GeneratedToken,
    PromptTrace,
    SegmentShare,
    Target,
    TokenProbability,
)
from agent_tools.prompt_trace.narrative import Answer, narrate
from agent_tools.schemas import ChatMessage, KeyWeight, rounded

NEXT_TOKENS_SHOWN = 5
TEXT_SHOWN = 80  # characters of a segment's text in the report


@dataclass
class TraceRun:
    """A trace's report plus the next-token logits at the last prompt position (for comparisons)."""

    report: PromptTrace
    answer_logits: Tensor | None


def trace(
    inspector: Inspector,
    loaded: LoadedModel,
    prompt: str | list[ChatMessage],
    named: list[SegmentSpec] | None,
    *,
    target: Target = "last",
    max_new_tokens: int = 16,
    top_k: int = 3,
    sink_threshold: float = DEFAULT_SINK_THRESHOLD,
) -> TraceRun:
    """Segment the prompt, run it (and generate, for target 'generate'), and build the report."""
    traced = trace_pass(
        inspector, loaded, prompt, named, target=target, max_new_tokens=max_new_tokens, sink_threshold=sink_threshold
    )
    return TraceRun(build_report(loaded, traced, top_k=top_k, sink_threshold=sink_threshold), traced.answer_logits)


def build_report(loaded: LoadedModel, traced: TracedPrompt, *, top_k: int, sink_threshold: float) -> PromptTrace:
    """The :class:`PromptTrace` of one traced pass."""
    numbers = measure(traced)
    prompt, names = traced.prompt, traced.prompt.names
    length, logits, generation = traced.prompt.encoded.length, traced.answer_logits, traced.generation
    generated = _generated_rows(loaded, traced, numbers) if traced.target == "generate" else None
    answer = Answer(
        generated=generated,
        text=_decode(loaded, traced.generated_ids, skip_special_tokens=True) if generated is not None else None,
        next_token=next_token_table(loaded, logits, 1)[0] if logits is not None else None,
    )
    summary, findings = narrate(traced, numbers, answer)
    sink, lead = prompt.index("sink"), numbers.lead
    return PromptTrace(
        model=loaded.name,
        summary=summary,
        findings=findings,
        target=traced.target,
        prompt_format=prompt.prompt_format,
        rendered_prompt=prompt.encoded.text,
        num_tokens=length,
        answer_position=length - 1,
        segments=[_segment_row(loaded, traced, numbers, i, top_k=top_k) for i in range(len(prompt.segments))],
        sink_positions=list(prompt.segments[sink].positions) if sink is not None else [],
        sink_threshold=sink_threshold,
        read_most=names[lead.best],
        runner_up=names[lead.runner_up] if lead.runner_up is not None else None,
        margin=rounded(lead.margin),
        next_tokens=next_token_table(loaded, logits) if logits is not None else None,
        generated_text=answer.text,
        generated=generated,
        stopped=generation.stopped if generation is not None else None,
        seconds_per_token=rounded(s) if generation is not None and (s := generation.seconds_per_token) else None,
    )


def next_token_table(loaded: LoadedModel, logits: Tensor, count: int = NEXT_TOKENS_SHOWN) -> list[TokenProbability]:
    """The ``count`` most likely next tokens of (V,) logits, decoded."""
    probabilities = torch.softmax(logits.double(), -1)
    values, indices = probabilities.topk(count)
    return [
        TokenProbability(token=_decode(loaded, [int(i)]), token_id=int(i), probability=rounded(v))
        for v, i in zip(values.tolist(), indices.tolist(), strict=True)
    ]


def _decode(loaded: LoadedModel, ids: list[int], *, skip_special_tokens: bool = False) -> str:
    """The tokenizer's text for ``ids`` (``LoadedModel.tokenizer`` is typed ``object``: any tokenizer)."""
    return str(loaded.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def _short(text: str, limit: int = TEXT_SHOWN) -> str:
    text = text.replace("\n", "⏎")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _token_text(loaded: LoadedModel, traced: TracedPrompt, position: int) -> str:
    """A key's text: a prompt token's, or the decoded token the model wrote at that position."""
    tokens = traced.prompt.encoded.tokens
    if position < len(tokens):
        return tokens[position].text
    return _decode(loaded, [traced.generated_ids[position - len(tokens)]])


def _segment_positions(traced: TracedPrompt, segment: Segment) -> list[int]:
    """The segment's key positions; for ``generated``, every generated token but the last (the keys written)."""
    if segment.kind == "generated":
        length = traced.prompt.encoded.length
        return list(range(length, length + max(len(traced.generated_ids) - 1, 0)))
    return list(segment.positions)


def _segment_row(
    loaded: LoadedModel, traced: TracedPrompt, numbers: TraceNumbers, index: int, *, top_k: int
) -> SegmentShare:
    segment, views, sink = traced.prompt.segments[index], numbers.views, traced.prompt.index("sink")
    positions = _segment_positions(traced, segment)
    if segment.char_start is not None and segment.char_end is not None:
        text = traced.prompt.encoded.text[segment.char_start : segment.char_end]
    else:
        text = "".join(_token_text(loaded, traced, p) for p in positions)
    token_weights = traced.shares.mean_token_weights()  # (Tk,)
    top = top_positions(token_weights, [p for p in positions if p < token_weights.shape[0]], top_k)
    share = views["share"][index]
    no_rollout = segment.kind == "generated"
    return SegmentShare(
        name=segment.name,
        kind=segment.kind,
        message=segment.message,
        token_count=len(positions),
        positions=positions,
        text=_short(text),
        share=rounded(share),
        share_without_sink=None if index == sink else rounded(views["free"][index]),
        share_per_token=rounded(share / len(positions)) if positions else 0.0,
        last_layer_share=rounded(views["last"][index]),
        rollout_share=None if no_rollout else rounded(views["rollout"][index]),
        rollout_share_without_sink=None if no_rollout or index == sink else rounded(views["rollout_free"][index]),
        top_tokens=[KeyWeight(position=p, token=_token_text(loaded, traced, p), weight=rounded(w)) for p, w in top],
    )


def _generated_rows(loaded: LoadedModel, traced: TracedPrompt, numbers: TraceNumbers) -> list[GeneratedToken]:
    """One row per generated token: the segment its attention read most, every share, the key read most."""
    names, accumulator = traced.prompt.names, traced.shares
    rows = []
    steps = zip(traced.generated_ids, accumulator.step_shares, accumulator.step_top_keys, strict=True)
    for step, (token_id, step_shares, (key, key_weight)) in enumerate(steps):
        step_lead = leading_segment(step_shares, numbers.eligible)
        rows.append(
            GeneratedToken(
                step=step,
                position=accumulator.prompt_length - 1 + step,
                token=_decode(loaded, [token_id]),
                token_id=token_id,
                read_most=names[step_lead.best],
                read_most_share=rounded(float(step_shares[step_lead.best])),
                shares={n: rounded(v) for n, v in zip(names, step_shares.tolist(), strict=True)},
                top_key=KeyWeight(position=key, token=_token_text(loaded, traced, key), weight=rounded(key_weight)),
            )
        )
    return rows
