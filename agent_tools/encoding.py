"""Encoding: text and chat messages to the tokens a pass reads (:class:`Encoded`), and what a decoder reads.

Tokenising keeps each token's characters (offsets) so reports can quote the text; chat messages go through the
model's chat template. Splitting a prompt into segments (system, turns, named spans) is
:mod:`agent_tools.prompt_segments`, which builds on this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from agent_tools import runner
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.loading import LoadedModel
from agent_tools.schemas import ChatMessage, Token
from agent_tools.usage import long_text_advice

CHARS_PER_TOKEN_CEILING = 64  # a text longer than limit·64 characters cannot fit, whatever the tokenizer


@dataclass(frozen=True)
class DecoderInput:
    """The decoder side of an encoder–decoder pass: what the decoder reads, teacher-forced.

    ``input_ids`` (1, n) are the decoder start token and the model's greedy answer without its last token, so
    row i is the query that chose ``answer[i]`` (one row per answer token); ``tokens`` label those rows.
    """

    input_ids: torch.Tensor
    tokens: list[Token]
    answer: list[int]  # the answer ids, answer[i] chosen at row i
    stopped: str  # "eos" or "max_new_tokens"

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[-1])


@dataclass(frozen=True)
class Encoded:
    """A tokenised input: ids (1, T), mask (1, T), tokens with positions, and the text they index.

    ``stack`` is the attention stack a pass over it captures (None = the model's default); for an
    encoder–decoder's ``"decoder"`` and ``"cross"`` stacks ``decoder`` holds what the decoder reads. The rows of a
    captured map are :attr:`query_tokens`, its columns :attr:`key_tokens` (both ``tokens`` for self-attention).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    tokens: list[Token]
    offsets: list[tuple[int, int]]
    text: str
    stack: str | None = None
    decoder: DecoderInput | None = None

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[-1])

    @property
    def query_tokens(self) -> list[Token]:
        """The tokens of the captured map's rows: the decoder's for the decoder and cross stacks."""
        return self.decoder.tokens if self.decoder is not None else self.tokens

    @property
    def key_tokens(self) -> list[Token]:
        """The tokens of the captured map's columns: the decoder's for the decoder stack, else the input's."""
        return self.decoder.tokens if self.decoder is not None and self.stack == "decoder" else self.tokens

    def query_labels(self) -> list[str]:
        return [f"{t.position}:{t.text}" for t in self.query_tokens]

    def key_labels(self) -> list[str]:
        return [f"{t.position}:{t.text}" for t in self.key_tokens]

    def on_stack(self, stack: str | None, decoder: DecoderInput | None = None) -> Encoded:
        """The same input, captured on ``stack`` (with what the decoder reads, for the decoder and cross)."""
        return replace(self, stack=stack, decoder=decoder)


def validate_text(text: str, *, field: str = "text") -> str:
    if not isinstance(text, str):
        raise InvalidInputError(f"{field} must be a string, got {type(text).__name__}", field=field)
    if not text.strip():
        raise InvalidInputError(f"{field} is empty or whitespace only; give at least one word", field=field)
    return check_unicode(text, field=field)


def check_unicode(text: str, *, field: str = "text") -> str:
    """Refuse strings that cannot be UTF-8 encoded (lone surrogates such as ``"\\ud800"`` from JSON escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        msg = (
            f"{field} holds characters that are not valid Unicode (e.g. lone surrogates at {exc.start}); "
            "send UTF-8 text"
        )
        raise InvalidInputError(msg, field=field) from exc
    return text


def _token_text(tokenizer: Any, token_id: int, text: str, offset: tuple[int, int] | None) -> str:
    piece = tokenizer.decode([token_id])
    if "\ufffd" in piece and offset is not None and offset[1] > offset[0]:
        return text[offset[0] : offset[1]]
    return piece


def render_messages(
    loaded: LoadedModel, messages: Sequence[ChatMessage | dict], *, add_generation_prompt: bool = True
) -> str:
    """The chat messages as the text the model's chat template makes of them (with the generation prompt)."""
    if not messages:
        raise InvalidInputError("messages is empty; give at least one {role, content} message", field="messages")
    parsed = [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in messages]
    for message in parsed:
        validate_text(message.content, field="messages.content")
    tokenizer = loaded.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        msg = f"model {loaded.name!r} has no chat template; send plain text instead"
        raise InvalidInputError(msg, field="messages")
    try:
        rendered = tokenizer.apply_chat_template(
            [m.model_dump() for m in parsed], tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # jinja raises TemplateError for roles a template does not accept
        raise InvalidInputError(f"the chat template refused these messages: {exc}", field="messages") from exc
    return str(rendered)  # tokenize=False gives the text


def encode(loaded: LoadedModel, text: str, *, limit: int, add_special_tokens: bool = True) -> Encoded:
    """Tokenise with offsets, enforcing the token ``limit`` (the model's positions or the session's)."""
    loaded.facts.require_text_input(loaded.name)  # Whisper & co. read audio features, not token ids
    validate_text(text)
    if len(text) > limit * CHARS_PER_TOKEN_CEILING:
        msg = f"text of {len(text):,} characters exceeds the token limit of {limit} tokens for {loaded.name!r}"
        raise ResourceLimitError(f"{msg}: {long_text_advice(limit)}", field="text")
    tokenizer = loaded.tokenizer
    encoding = tokenizer(text, return_offsets_mapping=True, add_special_tokens=add_special_tokens, return_tensors="pt")
    ids = encoding["input_ids"][:, :]
    length = ids.shape[-1]
    if length == 0:
        raise InvalidInputError("text produced no tokens; give at least one word", field="text")
    if length > limit:
        msg = f"text is {length:,} tokens; {loaded.name!r} accepts at most {limit:,} tokens here"
        raise ResourceLimitError(f"{msg}: {long_text_advice(limit)}", field="text")
    offsets = [(int(start), int(end)) for start, end in encoding["offset_mapping"][0].tolist()]
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    tokens = [  # tolist() gives Python ints
        Token(position=i, text=_token_text(tokenizer, t, text, offsets[i]), token_id=t, special=t in special_ids)
        for i, t in enumerate(ids[0].tolist())
    ]
    mask = encoding.get("attention_mask", torch.ones_like(ids))
    return Encoded(input_ids=ids, attention_mask=mask, tokens=tokens, offsets=offsets, text=text)


def decode(loaded: LoadedModel, ids: list[int], *, skip_special_tokens: bool = False) -> str:
    """The tokenizer's text for ``ids`` (``LoadedModel.tokenizer`` is typed ``object``: any tokenizer)."""
    return str(loaded.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def id_tokens(loaded: LoadedModel, ids: list[int]) -> list[Token]:
    """Tokens of ids with no text behind them, each decoded on its own."""
    special = set(getattr(loaded.tokenizer, "all_special_ids", []) or [])
    return [Token(position=i, text=decode(loaded, [t]), token_id=t, special=t in special) for i, t in enumerate(ids)]


def encode_ids(loaded: LoadedModel, ids: list[int]) -> Encoded:
    """Token ids (no text behind them) as an :class:`Encoded` of one sequence, every token unmasked."""
    input_ids = torch.tensor([ids])  # (1, T)
    mask, offsets = torch.ones_like(input_ids), [(0, 0)] * len(ids)
    return Encoded(input_ids=input_ids, attention_mask=mask, tokens=id_tokens(loaded, ids), offsets=offsets, text="")


def answer_input(loaded: LoadedModel, encoded: Encoded, generation: runner.Generation) -> DecoderInput:
    """What the decoder reads to reproduce ``generation`` teacher-forced: the start token + all but the last
    answer token."""
    start = runner.decoder_start_id(loaded)
    ids = [start, *generation.token_ids[:-1]]
    input_ids = torch.tensor([ids], dtype=encoded.input_ids.dtype)
    tokens, answer = id_tokens(loaded, ids), generation.token_ids
    return DecoderInput(input_ids=input_ids, tokens=tokens, answer=answer, stopped=generation.stopped)
