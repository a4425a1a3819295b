"""The calls that would confirm or refute a trace's lead, written out with their arguments (``next_calls``).

A trace's lead is a claim ("the answer depends on doc2", "it reads doc4 most"). The next call tests it from
another side: the whole output without that segment (``compare_prompts``), a second, independent account of the
dependence (the ``gradient`` check), and whether the head that reads the leader hardest matters
(``ablate_heads``). Pure: built from the report and the prompt as given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent_tools.prompt_segments import SegmentSpec
from agent_tools.prompt_trace.evidence import EvidenceRequest
from agent_tools.prompt_trace.measure import TracedPrompt
from agent_tools.prompt_trace.models import NextCall, PromptTrace, Target
from agent_tools.schemas import ROLES, ChatMessage


def _messages(prompt: Sequence[ChatMessage | dict]) -> list[dict[str, Any]]:
    return [dict(m) if isinstance(m, dict) else m.model_dump() for m in prompt]


def _as_argument(prompt: str | Sequence[ChatMessage]) -> str | list[dict[str, Any]]:
    return prompt if isinstance(prompt, str) else _messages(prompt)


def prompt_without(traced: TracedPrompt, prompt: str | Sequence[ChatMessage], name: str) -> Any:
    """The prompt as given with segment ``name`` left out (its message dropped, or its text cut); None when
    nothing would be left or the segment has no text of its own."""
    index = traced.prompt.index(name)
    if index is None:
        return None
    segment = traced.prompt.segments[index]
    if segment.char_start is None or segment.char_end is None:
        return None
    if isinstance(prompt, str):  # cut the characters of the segment's own tokens (a 'text' segment has holes)
        offsets = traced.prompt.encoded.offsets
        cut = sorted(offsets[p] for p in segment.positions if p < len(offsets))
        pieces, cursor = [], 0
        for start, end in cut:
            pieces.append(prompt[cursor:start])
            cursor = max(cursor, end)
        rest = " ".join(" ".join([*pieces, prompt[cursor:]]).split())
        return rest or None
    messages = _messages(prompt)
    if segment.kind in ROLES and segment.message is not None:
        kept = [m for i, m in enumerate(messages) if i != segment.message]
        return kept or None
    span = traced.prompt.encoded.text[segment.char_start : segment.char_end]
    if segment.message is None or span not in messages[segment.message]["content"]:
        return None
    content = messages[segment.message]["content"].replace(span, "", 1).strip()
    if not content:
        return None
    messages[segment.message] = {**messages[segment.message], "content": content}
    return messages


def _trace_arguments(
    report: PromptTrace, prompt: str | Sequence[ChatMessage], named: Sequence[SegmentSpec] | None, target: Target
) -> dict[str, Any]:
    arguments: dict[str, Any] = {"model": report.model, "prompt": _as_argument(prompt), "target": target}
    if named:
        arguments["segments"] = [spec.model_dump(exclude_none=True) for spec in named]
    return arguments


def trace_next_calls(
    report: PromptTrace,
    traced: TracedPrompt,
    prompt: str | Sequence[ChatMessage],
    named: Sequence[SegmentSpec] | None,
    *,
    request: EvidenceRequest,
    target: Target,
) -> list[NextCall]:
    """Up to three calls that test the trace's lead from another side."""
    calls: list[NextCall] = []
    lead = report.depends_on_most or report.read_most
    without = prompt_without(traced, prompt, lead)
    if without is not None:
        verb = "depends on" if report.depends_on_most else "reads"
        calls.append(
            NextCall(
                tool="compare_prompts",
                arguments={
                    "model": report.model,
                    "prompt_a": _as_argument(prompt),
                    "prompt_b": without,
                    "target": target,
                },
                why=f"the whole next-token distribution with {lead!r} left out: a large KL confirms the answer {verb} "
                "it, a small one refutes it",
            )
        )
    if "gradient" not in report.checks and report.answer_evidence is not None:
        arguments = _trace_arguments(report, prompt, named, target) | {"checks": ["causal", "gradient", "value"]}
        if request.answer is not None:
            arguments["answer"] = request.answer
        calls.append(
            NextCall(
                tool="trace_prompt_attention",
                arguments=arguments,
                why="integrated gradients: a second, independent account of which segment the answer depends on",
            )
        )
    top = next((f for f in report.findings if f.kind == "top_head"), None)
    if top is not None and top.layer is not None and top.head is not None:
        calls.append(
            NextCall(
                tool="ablate_heads",
                arguments={"model": report.model, "text": report.rendered_prompt, "heads": [f"{top.layer}.{top.head}"]},
                why=f"L{top.layer}H{top.head} reads {report.read_most!r} hardest; removing it shows whether that "
                "reading matters for the next token",
            )
        )
    return calls
