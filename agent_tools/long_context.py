"""Long-context passes the long-context tools share: short-cache losses, the needle-in-a-haystack inputs, and the
checks that refuse what would not fit, before any pass.

Each pass goes through the runner under the model's lock with the call's checkpoint (cancel, deadline) before every
layer (:func:`~agent_tools.session.guarded`), as :class:`~agent_tools.inspector.Inspector`'s own passes do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel
from agent_tools.runner.patching import row_bytes, rows_per_batch
from agent_tools.runner.short_cache import RestrictedLosses, restricted_pass, unit_losses
from agent_tools.session import guarded
from agent_tools.settings import readable_size

MAX_RESTRICTED_ROWS = 32  # rows of one masked pass at most (row 0 and up to 31 restricted KV heads)


def check_short_cache(length: int, sink: int, window: int) -> int:
    """The number of scored positions (predictions made by queries at ``sink + window`` or later), or an error
    naming the valid range when the short cache covers the whole text."""
    if sink < 0 or window < 1:
        msg = f"sink must be >= 0 and window >= 1 tokens, got sink {sink}, window {window}"
        raise InvalidInputError(msg, field="window")
    scored = length - 1 - (sink + window)
    if scored < 1:
        msg = (
            f"sink {sink} + window {window} = {sink + window} tokens covers the whole text of {length} tokens, so no "
            f"head would lose a key; use sink + window <= {max(length - 2, 0)} (or a longer text)"
        )
        raise InvalidInputError(msg, field="window")
    return scored


def restricted_rows(inspector: Inspector, loaded: LoadedModel, length: int) -> int:
    """Rows one masked pass may carry within the call's memory budget (at least 2: the unrestricted row and one)."""
    rows = min(rows_per_batch(loaded, length, inspector.memory_budget), MAX_RESTRICTED_ROWS)
    if rows < 2:
        low, high = 1, length  # the longest text whose two rows fit (row_bytes grows with length² when eager)
        while low < high:
            middle = (low + high + 1) // 2
            fits = 2 * row_bytes(loaded, middle) <= inspector.memory_budget
            low, high = (middle, high) if fits else (low, middle - 1)
        most = low
        msg = (
            f"a masked pass over {length} tokens needs two rows of about {readable_size(row_bytes(loaded, length))} "
            f"each (activations, and one layer's attention scores on an eager model), over the budget of "
            f"{readable_size(inspector.memory_budget)}; use a text of at most {most} tokens (or a larger memory budget)"
        )
        raise ResourceLimitError(msg, field="text")
    return rows


def short_cache_losses(
    inspector: Inspector,
    loaded: LoadedModel,
    input_ids: Tensor,
    units: Sequence[tuple[int, Sequence[int]]],
    *,
    sink: int,
    window: int,
) -> RestrictedLosses:
    """Every unit (layer, query heads) restricted on its own: one masked pass per layer group."""
    rows = restricted_rows(inspector, loaded, int(input_ids.shape[-1]))
    with guarded(loaded):
        return unit_losses(loaded, input_ids, units, sink=sink, window=window, max_rows=rows)


def all_restricted_losses(
    loaded: LoadedModel,
    input_ids: Tensor,
    units: Sequence[tuple[int, Sequence[int]]],
    *,
    sink: int,
    window: int,
    clean_row: bool = True,
) -> tuple[Tensor, Tensor]:
    """Row 0 unrestricted and row 1 with every unit restricted at once: (2, S) losses and top tokens of the scored
    predictions (positions ``sink + window`` and later). ``clean_row=False``: only the restricted row, (1, S) (the
    caller holds the unrestricted losses already)."""
    row = 1 if clean_row else 0
    restrictions: dict[int, list[tuple[int, Sequence[int]]]] = {}
    for layer, heads in units:
        restrictions.setdefault(layer, []).append((row, tuple(heads)))
    with guarded(loaded):
        return restricted_pass(
            loaded, input_ids, restrictions, rows=row + 1, sink=sink, window=window, scored_from=sink + window
        )


# --- needle in a haystack ---------------------------------------------------------------------------------------
DEFAULT_HAYSTACK = (
    "The harbour town woke slowly. Fishing boats came in with the tide, and the market filled with crates of "
    "mackerel, crab and salt cod. Children ran between the stalls while the baker argued with the miller about the "
    "price of flour. Up on the hill the old lighthouse keeper wrote the weather into his logbook, as he had every "
    "morning for thirty years: wind from the west, light rain, a grey sea. In the afternoon the school bell rang and "
    "the teacher read a chapter about the history of the river, which had flooded the lower streets twice in living "
    "memory. The council had promised a new sea wall, but the money had gone to repair the bridge instead. "
)
DEFAULT_NEEDLE = "The secret passphrase for the vault is amber falcon river."
DEFAULT_ANSWER = "amber falcon river"
DEFAULT_QUESTION = "Question: what is the secret passphrase for the vault? Answer: the secret passphrase is"


@dataclass(frozen=True)
class Haystack:
    """One needle-in-a-haystack input: token ids with the needle at a depth, then the question and the answer."""

    ids: Tensor  # (T,)
    depth: float  # asked depth (0 = start of the haystack, 1 = its end)
    length: int  # T
    needle: tuple[int, int]  # [start, stop) token span of the needle
    answer_queries: tuple[int, ...]  # positions whose next token is an answer token (teacher forced)


@dataclass(frozen=True)
class NeedleTokens:
    """The pieces, tokenised once: haystack, needle (with the answer inside), question, answer."""

    prefix: list[int]  # special tokens the tokenizer puts first (e.g. <bos>)
    haystack: list[int]
    needle: list[int]
    question: list[int]
    answer: list[int]


def needle_tokens(loaded: LoadedModel, haystack: str, needle: str, answer: str, question: str) -> NeedleTokens:
    """Tokenise the pieces; the answer's tokens appear in the needle exactly (the needle is tokenised around it)."""
    tokenizer = loaded.tokenizer
    at = needle.find(answer)
    if not answer.strip() or at < 0:
        raise InvalidInputError(f"answer {answer!r} must be a non-empty part of the needle {needle!r}", field="answer")

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    before, after = needle[:at], needle[at + len(answer) :]
    spaced = " " + answer.strip() if before.endswith(" ") else answer
    before = before[:-1] if before.endswith(" ") else before
    answer_ids = ids(spaced)
    prefix_ids = list(tokenizer("", add_special_tokens=True)["input_ids"])
    return NeedleTokens(
        prefix=prefix_ids,
        haystack=ids(haystack),
        needle=[*ids(" " + before.strip()), *answer_ids, *ids(after)],
        question=ids(" " + question.strip()),
        answer=answer_ids,
    )


def check_haystack(pieces: NeedleTokens, lengths: Sequence[int], limit: int) -> None:
    """Refuse lengths the model cannot take or the pieces cannot fill, naming the valid range."""
    fixed = len(pieces.prefix) + len(pieces.needle) + len(pieces.question) + len(pieces.answer)
    if not pieces.haystack:
        raise InvalidInputError("the haystack text produced no tokens; give a longer text", field="text")
    for length in lengths:
        if length > limit:
            msg = f"context length {length} is over this model's limit here; use lengths {fixed + 1}..{limit}"
            raise ResourceLimitError(msg, field="lengths")
        if length <= fixed:
            msg = (
                f"context length {length} leaves no room for a haystack: the needle ({len(pieces.needle)} tokens), "
                f"question and answer take {fixed}; use lengths {fixed + 1}..{limit}"
            )
            raise InvalidInputError(msg, field="lengths")
    if len(pieces.needle) > len(pieces.haystack):
        msg = (
            f"the needle ({len(pieces.needle)} tokens) is longer than the haystack text ({len(pieces.haystack)} "
            f"tokens); give a haystack text of at least {len(pieces.needle)} tokens (or a shorter needle)"
        )
        raise InvalidInputError(msg, field="needle")


def build_haystack(pieces: NeedleTokens, length: int, depth: float) -> Haystack:
    """The haystack text repeated (or cut) to fill ``length`` tokens, the needle inserted at ``depth`` of it."""
    fill = length - len(pieces.prefix) - len(pieces.needle) - len(pieces.question) - len(pieces.answer)
    repeats = -(-fill // len(pieces.haystack))
    hay = (pieces.haystack * repeats)[:fill]
    at = round(depth * fill)
    ids = [*pieces.prefix, *hay[:at], *pieces.needle, *hay[at:], *pieces.question, *pieces.answer]
    start = len(pieces.prefix) + at
    first_answer = len(ids) - len(pieces.answer)
    queries = tuple(range(first_answer - 1, len(ids) - 1))
    return Haystack(
        ids=torch.tensor(ids, dtype=torch.long),
        depth=depth,
        length=len(ids),
        needle=(start, start + len(pieces.needle)),
        answer_queries=queries,
    )
