"""Induction probes: ``[prefix] r₁…r_N r₁…r_N [suffix]``, N distinct random tokens repeated once.

A head that attends from the second copy's token ``rᵢ`` to the token after its first occurrence (``rᵢ₊₁``) is
doing induction; random tokens mean no text statistics can explain it. The probe is built from token ids, not
text, so it is the same for every tokenizer quirk, and the same seed always gives the same probe.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

import torch

from agent_tools.encoding import encode_ids
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Encoded, Inspector
from agent_tools.loading import LoadedModel

DEFAULT_PROBE_LENGTH = 32
MIN_PROBE_LENGTH = 4
_RESERVED_TOKEN = re.compile(r"^(\[.*\]|<.*>)$")
_VOCABULARY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> usable ids, computed once


@dataclass(frozen=True)
class Probe:
    """A built probe: the encoded tokens, where the first copy starts, and N (tokens per copy)."""

    encoded: Encoded
    start: int
    repeat_length: int


def probe_vocabulary(loaded: LoadedModel) -> torch.Tensor:
    """Token ids a probe may draw: not special, not a reserved marker like [unused0] or <filename>."""
    tokenizer = loaded.tokenizer
    cached = _VOCABULARY.get(tokenizer)
    if cached is not None:
        return cached
    embeddings = loaded.model.get_input_embeddings()  # type: ignore[operator]
    size = min(len(tokenizer), int(embeddings.num_embeddings))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    ids = torch.tensor(
        [i for i, piece in enumerate(pieces) if i not in special and piece and not _RESERVED_TOKEN.match(piece)]
    )
    _VOCABULARY[tokenizer] = ids
    return ids


def special_frame(loaded: LoadedModel) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts around a text (e.g. [CLS] … [SEP]); a causal model with none gets BOS."""
    tokenizer = loaded.tokenizer
    framed = tokenizer("a", add_special_tokens=True)["input_ids"]
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    prefix: list[int] = []
    suffix: list[int] = []
    for start in range(len(framed) - len(bare) + 1):
        if framed[start : start + len(bare)] == bare:
            prefix, suffix = list(framed[:start]), list(framed[start + len(bare) :])
            break
    if not prefix and loaded.facts.is_causal:
        bos = getattr(tokenizer, "bos_token_id", None)
        bos = bos if bos is not None else loaded.facts.bos_token_id
        if bos is not None:
            prefix = [int(bos)]
    return prefix, suffix


def probe_repeat_length(requested: int | None, *, name: str, limit: int, frame: int, vocabulary: int) -> int:
    """N for a probe of ``frame`` special tokens + 2N within ``limit`` tokens, drawn from ``vocabulary`` ids.

    ``requested=None`` takes :data:`DEFAULT_PROBE_LENGTH`, shortened to what fits; a requested N that does not
    fit is refused with the valid range.
    """
    most = (limit - frame) // 2
    if requested is None:
        requested = min(DEFAULT_PROBE_LENGTH, most, vocabulary)
        if requested < MIN_PROBE_LENGTH:
            msg = f"{name!r} allows only {limit} tokens: too few for a probe of two copies of {MIN_PROBE_LENGTH} tokens"
            raise ResourceLimitError(msg, field="probe_length")
    if requested > vocabulary:
        msg = f"probe_length {requested} exceeds the {vocabulary} usable tokens of {name!r}"
        raise InvalidInputError(msg, field="probe_length")
    if requested > most:
        msg = f"probe_length {requested} makes a probe longer than {limit} tokens; use {MIN_PROBE_LENGTH}..{most}"
        raise ResourceLimitError(msg, field="probe_length")
    return requested


def build_probe(inspector: Inspector, loaded: LoadedModel, repeat_length: int | None, seed: int) -> Probe:
    """[prefix] r₁…r_N r₁…r_N [suffix] with N distinct random tokens drawn by ``seed``.

    ``repeat_length=None`` takes the default N, shortened to what the model's positions and vocabulary allow.
    """
    vocabulary = probe_vocabulary(loaded)
    prefix, suffix = special_frame(loaded)
    repeat_length = probe_repeat_length(
        repeat_length,
        name=loaded.name,
        limit=inspector.limit_for(loaded),
        frame=len(prefix) + len(suffix),
        vocabulary=len(vocabulary),
    )
    generator = torch.Generator().manual_seed(seed)
    chosen = vocabulary[torch.randperm(len(vocabulary), generator=generator)[:repeat_length]].tolist()
    encoded = encode_ids(loaded, [*prefix, *chosen, *chosen, *suffix])
    return Probe(encoded=encoded, start=len(prefix), repeat_length=repeat_length)
