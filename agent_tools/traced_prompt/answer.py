"""Where a generated answer ends (``answer_stop``) and which of its tokens the checks measure.

Generation stops at the end of the model's turn (EOS), at the ``max_new_tokens`` cap, or earlier by the rule
asked for: ``line`` — the first line break after some text (the default: one answer, not an invented next
question); ``sentence`` — also after a sentence end (. ! ? followed by a space); ``eos`` and ``tokens`` — no
earlier stop. The stop token itself (EOS, a token that is only whitespace, the first token of the next sentence)
is generated and traced but left out of the answer the checks measure.
"""

from __future__ import annotations

import re

from agent_tools.encoding import decode
from agent_tools.loading import LoadedModel
from agent_tools.runner import StopReason, StopRule
from agent_tools.traced_prompt.measure import TracedPrompt
from agent_tools.traced_prompt.models import AnswerStop

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")
_SENTENCE_BREAK = re.compile(r"\S.*?[.!?][\"')\]]*\s", re.DOTALL)


def _line_break(text: str) -> bool:
    """A line break after some text (leading line breaks do not end an answer)."""
    first = text.find("\n", len(text) - len(text.lstrip()))
    return first >= 0


def stop_rule(loaded: LoadedModel, stop: AnswerStop) -> StopRule | None:
    """The generation's stop rule for ``answer_stop`` (None: only EOS and the cap stop it)."""
    if stop in ("eos", "tokens"):
        return None

    def rule(ids: list[int]) -> StopReason | None:
        text = decode(loaded, ids, skip_special_tokens=True)
        if _line_break(text):
            return "line"
        if stop == "sentence" and _SENTENCE_BREAK.search(text):
            return "sentence"
        return None

    return rule


def measured_ids(loaded: LoadedModel, ids: list[int], stopped: str | None) -> list[int]:
    """The generated tokens the checks measure: the answer without the token that stopped it (EOS, a token that
    is only whitespace, or the first token after a sentence end); the whole answer when nothing else is left."""
    if len(ids) <= 1:
        return list(ids)
    last = decode(loaded, ids[-1:], skip_special_tokens=True)
    if stopped == "eos" or (stopped in ("line", "sentence") and not last.strip()):
        return list(ids[:-1])
    if stopped == "sentence" and _SENTENCE_END.search(decode(loaded, ids[:-1], skip_special_tokens=True).rstrip()):
        return list(ids[:-1])
    return list(ids)


STOP_WORDS = {
    "eos": "the end of its turn (the end token left out)",
    "line": "its first line break (the break left out when it is a token of its own)",
    "sentence": "the end of its first sentence",
    "max_new_tokens": "the max_new_tokens cap",
}


def covers(traced: TracedPrompt, source: str, tokens: list[str], cap: int) -> str:
    """What the measured answer (``tokens``, from ``source`` 'model' or 'given'; ``cap``: max_new_tokens) is,
    in words."""
    if source == "given":
        return f"the given answer, {len(tokens)} token(s), teacher-forced after the prompt"
    if traced.target == "last":
        return (
            f"one token: the model's most likely next token {tokens[0]!r} at the prompt's end (target 'last'; "
            "target 'generate' or answer measure a whole answer)"
        )
    stopped = traced.generation.stopped if traced.generation is not None else None
    where = STOP_WORDS.get(stopped or "", "the end")
    if stopped == "max_new_tokens":
        where += f" ({cap})"
    return f"the model's generated answer, {len(tokens)} token(s), up to {where}"
