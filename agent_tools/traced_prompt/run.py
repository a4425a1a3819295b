"""One traced prompt, start to end: segment it, check the evidence request, run the pass, run the checks, read
the numbers.

:func:`trace` is what both prompt tools call: ``trace_prompt_attention`` writes its report from the
:class:`TraceRun`, and ``compare_prompts`` traces two variants and compares their numbers and next-token logits.
Before any pass, :func:`check_stack` refuses a stack or checks the model cannot trace and :func:`check_prompt`
segments a prompt and validates the request against it; compare_prompts checks both variants before either runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel
from agent_tools.prompt_segments import SegmentSpec, segment_prompt
from agent_tools.schemas import ChatMessage
from agent_tools.traced_prompt.answer import stop_rule
from agent_tools.traced_prompt.evidence import Evidence, EvidenceRequest, Prepared, Verdict, gather, prepare, verdict
from agent_tools.traced_prompt.measure import (
    TracedPrompt,
    TraceNumbers,
    check_traceable,
    measure,
    seq2seq_trace_pass,
    trace_pass,
)
from agent_tools.traced_prompt.models import AnswerStop, MeasuredTrace, Target
from agent_tools.traced_prompt.rows import measured_trace


@dataclass(frozen=True)
class TraceRun:
    """A traced prompt, measured and checked: the pass, its numbers, the checks' evidence and verdict, and the
    report rows (``measured``) built from them."""

    traced: TracedPrompt
    numbers: TraceNumbers
    evidence: Evidence
    verdict: Verdict
    measured: MeasuredTrace


def trace_options(args: Any) -> dict[str, Any]:
    """:func:`trace`'s options from a prompt tool's arguments (``target``, ``max_new_tokens``, ``sink_threshold``,
    ``answer_stop``: the fields trace_prompt_attention and compare_prompts share)."""
    fields = ("target", "max_new_tokens", "sink_threshold", "answer_stop")
    return {name: getattr(args, name) for name in fields}


def check_stack(inspector: Inspector, loaded: LoadedModel, attention: str | None, request: EvidenceRequest) -> None:
    """Refuse a stack the trace has no meaning on, and on an encoder–decoder (traced on its cross-attention, the
    default ``attention``) checks asked for by name."""
    stack = inspector.attention_stack(loaded, attention, seq2seq_default="cross")
    if loaded.facts.is_encoder_decoder:
        inspector.require_stack(loaded, stack, ("cross",), SEQ2SEQ_STACKS)
        if request.explicit and request.checks:
            raise InvalidInputError(f"{SEQ2SEQ_CHECKS}; omit checks", field="checks")


def check_prompt(
    inspector: Inspector,
    loaded: LoadedModel,
    prompt: str | list[ChatMessage],
    named: list[SegmentSpec] | None,
    request: EvidenceRequest,
    *,
    field: str = "prompt",
) -> Prepared:
    """Segment the prompt (``field`` names it in the error when it is too short to trace) and validate the
    evidence request against the model and the segments, before any pass runs."""
    segmented = check_traceable(segment_prompt(inspector, loaded, prompt, named), field=field)
    if loaded.facts.is_encoder_decoder:  # its cross-attention trace runs no checks
        return Prepared(
            segmented, request, causal=False, gradient=False, value_grams=None, neutral_id=None, answer_ids=None
        )
    return prepare(inspector, loaded, segmented, request)


def trace(
    inspector: Inspector,
    loaded: LoadedModel,
    prepared: Prepared,
    *,
    target: Target,
    max_new_tokens: int,
    sink_threshold: float,
    answer_stop: AnswerStop,
    top_k: int = 3,
) -> TraceRun:
    """Run a prompt :func:`check_prompt` prepared (and generate, for target 'generate', ending the answer per
    ``answer_stop``), run the checks, and read the numbers.

    On an encoder–decoder the trace is of the cross-attention: the answer's tokens reading the input
    (:func:`~agent_tools.traced_prompt.measure.seq2seq_trace_pass`)."""
    segmented, request = prepared.prompt, prepared.request
    length = segmented.encoded.length
    inspector.check_budget(3 * length * length * 4, "attention rollout over the prompt")
    stop_when = stop_rule(loaded, answer_stop) if target == "generate" else None
    options: dict[str, Any] = {"target": target, "max_new_tokens": max_new_tokens, "sink_threshold": sink_threshold}
    if loaded.facts.is_encoder_decoder:  # the answer's cross-attention reading the input; no checks
        traced = seq2seq_trace_pass(inspector, loaded, segmented, **options, stop_when=stop_when)
        notes = [f"{SEQ2SEQ_CHECKS} (skipped)"] if request.checks else []
        found = Evidence([], "model", notes=[*notes, SEQ2SEQ_ROLLOUT])
    else:
        options |= {"value_grams": prepared.value_grams, "keep_cache": prepared.causal and target == "last"}
        traced = trace_pass(inspector, loaded, segmented, **options, stop_when=stop_when)
        found = gather(inspector, loaded, traced, prepared)
    numbers = measure(traced, exclude_filler=request.exclude_filler)
    checked = verdict(traced, numbers, found)
    rows = measured_trace(
        loaded,
        traced,
        numbers,
        found,
        checked,
        top_k=top_k,
        sink_threshold=sink_threshold,
        answer_stop=answer_stop,
        max_new_tokens=max_new_tokens,
        neutral_id=prepared.neutral_id,
    )
    return TraceRun(traced, numbers, found, checked, rows)


SEQ2SEQ_STACKS = (
    "an encoder–decoder's answer reads its input through cross-attention, which is what trace_prompt_attention "
    "traces; the encoder and decoder stacks are per-layer maps (show_attention, diagnose_collapse with attention=...)"
)
SEQ2SEQ_CHECKS = (
    "the checks beside attention (causal, value, gradient) are not run on an encoder–decoder's cross-attention trace"
)
SEQ2SEQ_ROLLOUT = (
    "rollout on cross-attention: the answer tokens' cross-attention (mean over them, the decoder layers and heads) "
    "carried back to the input through the encoder's rollout (every decoder layer reads the same encoder output); "
    "the decoder's own self-attention is left out"
)
