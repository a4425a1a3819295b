"""position_sensitivity's passes: one captured forward per position of the moved segment (answer appended)."""

from __future__ import annotations

import itertools

import torch

from agent_tools.consumers.span_share import SpanShareConsumer
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Encoded, Inspector
from agent_tools.loading import LoadedModel
from agent_tools.prompt_segments import SegmentSpec, segment_prompt
from agent_tools.schemas import ChatMessage, NextCall
from agent_tools.tools.position_sensitivity.models import (
    PositionResult,
    PositionSensitivityInput,
    PositionSensitivityReport,
)
from agent_tools.tools.position_sensitivity.narrative import curve_shape, findings, summary
from agent_tools.traced_prompt.models import prompt_argument

Prompt = str | list[ChatMessage]


def _content(prompt: Prompt, index: int | None) -> str:
    return prompt if isinstance(prompt, str) else prompt[index or 0].content


def _locate(args: PositionSensitivityInput) -> tuple[int | None, list[tuple[int, int, str]]]:
    """The message holding every segment (None for a text prompt) and the segments' (start, end, name), sorted."""
    names = [s.name for s in args.segments]
    if args.move not in names:
        raise InvalidInputError(f"move {args.move!r} is not a segment; segments: {names}", field="move")
    if len(set(names)) != len(names):
        raise InvalidInputError(f"segment names must be distinct, got {names}", field="segments")
    messages = [None] if isinstance(args.prompt, str) else list(range(len(args.prompt)))
    for spec in args.segments:
        if not spec.text:
            msg = f"segment {spec.name!r} needs its verbatim text (position_sensitivity moves text, not characters)"
            raise InvalidInputError(msg, field="segments")
    for index in messages:
        if any(s.message is not None and s.message != index for s in args.segments):
            continue
        content = _content(args.prompt, index)
        spans = []
        for spec in args.segments:
            at = -1
            for _ in range(spec.occurrence):
                at = content.find(spec.text or "", at + 1)
                if at < 0:
                    break
            if at < 0:
                break
            spans.append((at, at + len(spec.text or ""), spec.name))
        if len(spans) == len(args.segments):
            spans.sort()
            if any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
                raise InvalidInputError("segments overlap; give disjoint pieces", field="segments")
            return index, spans
    msg = "every segment must be a verbatim substring of one and the same message (or of the text prompt)"
    raise InvalidInputError(msg, field="segments")


def _variant(args: PositionSensitivityInput, index: int | None, spans: list[tuple[int, int, str]], slot: int) -> Prompt:
    """The prompt with the moved segment at ``slot`` among the others; the gaps between segments stay in place."""
    content = _content(args.prompt, index)
    texts = {name: content[start:end] for start, end, name in spans}
    others = [name for _, _, name in spans if name != args.move]
    order = [*others[:slot], args.move, *others[slot:]]
    pieces = [content[: spans[0][0]]]
    for rank, name in enumerate(order):
        pieces.append(texts[name])
        pieces.append(
            content[spans[rank][1] : spans[rank + 1][0]] if rank + 1 < len(spans) else content[spans[-1][1] :]
        )
    rebuilt = "".join(pieces)
    if isinstance(args.prompt, str):
        return rebuilt
    return [m.model_copy(update={"content": rebuilt}) if i == index else m for i, m in enumerate(args.prompt)]


def _slots(count: int, wanted: int) -> list[int]:
    """``wanted`` slots of 0..count−1 evenly spread, first and last kept."""
    wanted = min(wanted, count)
    return sorted({round(i * (count - 1) / (wanted - 1)) for i in range(wanted)})


def _answer_ids(inspector: Inspector, loaded: LoadedModel, args: PositionSensitivityInput) -> list[int]:
    if args.answer is not None:
        ids = list(loaded.tokenizer(args.answer, add_special_tokens=False)["input_ids"])
        if not ids:
            raise InvalidInputError("answer produced no tokens; give at least one word", field="answer")
        return ids
    segmented = segment_prompt(inspector, loaded, args.prompt, [])
    logits = inspector.answer_logits(loaded, segmented.encoded)
    assert logits is not None
    return [int(logits.argmax())]


def position_sensitivity(inspector: Inspector, args: PositionSensitivityInput) -> PositionSensitivityReport:
    """Move one segment through positions among the others; the answer's log-probability and its attention share."""
    loaded = inspector.model(args.model)
    if not loaded.facts.is_language_model or loaded.facts.is_encoder_decoder:
        msg = f"position_sensitivity needs a decoder-only causal LM; {loaded.name!r} is not"
        raise InvalidInputError(msg, field="model")
    index, spans = _locate(args)
    answer = _answer_ids(inspector, loaded, args)
    moved_text = next(s.text for s in args.segments if s.name == args.move)
    results = []
    for slot in _slots(len(spans), args.positions):
        prompt = _variant(args, index, spans, slot)
        spec = SegmentSpec(name=args.move, text=moved_text, message=index)
        segmented = segment_prompt(inspector, loaded, prompt, [spec])
        encoded = segmented.encoded
        segment = segmented.segments[segmented.index(args.move) or 0]
        ids = torch.cat([encoded.input_ids, torch.tensor([answer], dtype=encoded.input_ids.dtype)], dim=-1)
        rows = list(range(encoded.length - 1, encoded.length - 1 + len(answer)))
        consumer = SpanShareConsumer(rows, [p for p in segment.positions if p != 0])  # key 0: the sink, not content
        full = Encoded(input_ids=ids, attention_mask=torch.ones_like(ids), tokens=[], offsets=[], text="")
        output = inspector.run(loaded, full, [consumer])
        logits = output.logits[0, rows].float()  # (A, V)
        target = torch.tensor(answer, device=logits.device)
        logprob = float(torch.log_softmax(logits, -1).gather(-1, target[:, None]).sum())
        start = segment.positions[0] if segment.positions else 0
        results.append(
            PositionResult(
                slot=slot,
                start_token=start,
                prompt_tokens=encoded.length,
                relative_depth=start / encoded.length,
                answer_logprob=logprob,
                top_token_is_answer=int(logits[0].argmax()) == answer[0],
                attention_share=consumer.share,
            )
        )
    values = [r.answer_logprob for r in results]
    best, worst = max(results, key=lambda r: r.answer_logprob), min(results, key=lambda r: r.answer_logprob)
    report = PositionSensitivityReport(
        model=loaded.name,
        summary="",
        findings=[],
        moved=args.move,
        answer=str(loaded.tokenizer.decode(answer)),
        positions=results,
        best_slot=best.slot,
        worst_slot=worst.slot,
        spread=best.answer_logprob - worst.answer_logprob,
        shape=curve_shape(values),
        next_calls=[
            NextCall(
                tool="trace_prompt_attention",
                arguments={
                    "model": loaded.name,
                    "prompt": prompt_argument(args.prompt),
                    "segments": [s.model_dump(exclude_none=True) for s in args.segments],
                },
                why="which segment the answer reads and depends on at the original position (causal check)",
            )
        ],
    )
    return report.model_copy(update={"summary": summary(report), "findings": findings(report)})
