"""The calls that would confirm or refute a trace's lead, written out with their arguments (``next_calls``).

A trace's lead is a claim ("the answer depends on doc2", "it reads doc4 most"). The next call tests it from
another side: the whole output without that segment (``compare_prompts``), the gradient check (an approximation
of removal whose agreement with it the report states), and whether the head that reads the leader hardest
matters (``ablate_heads``). Pure: built from the report and the prompt as given. Every text argument is exact:
the prompt as given, character for character, and a variant is that prompt with exactly the segment's characters
cut out (no whitespace joined, trimmed or collapsed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent_tools.prompt_segments import uncovered
from agent_tools.schemas import ROLES, ChatMessage, NextCall, follow_up, head_label
from agent_tools.tools.trace_prompt_attention.models import PromptTrace, TracePromptInput
from agent_tools.traced_prompt.measure import TracedPrompt
from agent_tools.traced_prompt.models import generation_arguments, messages_argument, prompt_argument
from agent_tools.wording import head_name


def prompt_without(traced: TracedPrompt, prompt: str | Sequence[ChatMessage], name: str) -> Any:
    """The prompt as given with segment ``name`` left out (its message dropped, or its text cut); None when
    nothing would be left or the segment has no text of its own."""
    index = traced.prompt.index(name)
    if index is None:
        return None
    segment = traced.prompt.segments[index]
    if segment.char_start is None or segment.char_end is None:
        return None
    if isinstance(prompt, str):  # cut exactly the segment's characters (a gap: the text outside the named spans)
        rest = _cut(prompt, _owned_characters(traced, name))
        return rest if rest.strip() else None
    messages = messages_argument(prompt)
    if segment.kind in ROLES and segment.message is not None and not segment.gap:
        kept = [m for i, m in enumerate(messages) if i != segment.message]
        return kept or None
    if segment.message is None:
        return None
    base = _content_start(traced, segment.message)
    content = messages[segment.message]["content"]
    if base is None or traced.prompt.encoded.text[base : base + len(content)] != content:
        return None  # the template stripped or changed the content: no exact cut
    content = _cut(content, [(a - base, b - base) for a, b in _owned_characters(traced, name)])
    if not content.strip():
        return None
    messages[segment.message] = {**messages[segment.message], "content": content}
    return messages


def _owned_characters(traced: TracedPrompt, name: str) -> list[tuple[int, int]]:
    """Character spans (rendered text) the segment owns: its span less the named spans inside it (a gap)."""
    prompt = traced.prompt
    segment = prompt.segments[prompt.index(name) or 0]
    assert segment.char_start is not None and segment.char_end is not None
    inner = [
        (s.char_start, s.char_end)
        for s in prompt.segments
        if s.kind == "named"
        and s.name != name
        and s.char_start is not None
        and s.char_end is not None
        and segment.char_start <= s.char_start
        and s.char_end <= segment.char_end
    ]
    return uncovered(inner, segment.char_start, segment.char_end)


def _cut(text: str, spans: Sequence[tuple[int, int]]) -> str:
    """``text`` with exactly the characters of ``spans`` removed; nothing else changes."""
    return "".join(text[start:end] for start, end in uncovered(spans, 0, len(text)))


def _content_start(traced: TracedPrompt, message: int) -> int | None:
    """Where message ``message``'s content starts in the rendered text (its role segment's first character)."""
    return next((s.char_start for s in traced.prompt.segments if s.kind in ROLES and s.message == message), None)


def trace_next_calls(report: PromptTrace, traced: TracedPrompt, args: TracePromptInput) -> list[NextCall]:
    """Up to three calls that test the trace's lead from another side (``args``: the trace's own arguments)."""
    calls: list[NextCall] = []
    prompt, named = args.prompt, args.segments
    generation = generation_arguments(args.target, args.answer_stop, args.max_new_tokens)
    given = {"answer": args.answer} if args.answer is not None else {}  # the answer the trace measured
    lead = report.moves_most or report.read_most
    without = prompt_without(traced, prompt, lead)
    if without is not None:
        verb = "moves with" if report.moves_most else "reads"
        arguments = {"model": report.model, "prompt_a": prompt_argument(prompt), "prompt_b": without}
        arguments |= generation | given
        calls.append(
            NextCall(
                tool="compare_prompts",
                arguments=arguments,
                why=f"prompt_b is the prompt with exactly {lead!r}'s characters cut out: the whole next-token "
                f"distribution without it (a large KL confirms the answer {verb} it, a small one refutes it)",
            )
        )
    if "gradient" not in report.checks and report.answer_evidence is not None:
        arguments = {"model": report.model, "prompt": prompt_argument(prompt), **generation}
        if named:
            arguments["segments"] = [spec.model_dump(exclude_none=True) for spec in named]
        arguments |= {"checks": ["causal", "gradient", "value"]} | given
        calls.append(
            NextCall(
                tool="trace_prompt_attention",
                arguments=arguments,
                why="integrated gradients: an approximation of removal (slow); the report says how well it agrees "
                "with the removal ranking on this prompt",
            )
        )
    top = next((f for f in report.findings if f.kind == "top_head"), None)
    if top is not None and top.layer is not None and top.head is not None:
        calls.append(
            follow_up(
                "ablate_heads",
                {"text": report.rendered_prompt, "heads": [head_label(top.layer, top.head)]},
                f"{head_name(top.layer, top.head)} reads {report.read_most!r} hardest; removing it shows whether that "
                "reading matters for the next token",
                model=report.model,
            )
        )
    return calls
