"""Greedy generation with the KV cache under attention capture, streaming one step at a time.

The prompt goes through the model once (query-chunked like any captured forward); then each new token is fed
alone with the cache, so every step's layer call has one query row and ``past + 1`` keys. Consumers see every
layer call as it happens; :class:`LastRowConsumer` keeps only the last query row of each layer, which the
caller reduces to a few numbers per step (``on_step``) — the T² maps of the steps are never held.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from agent_tools.analysis.segments import Received, received_attention
from agent_tools.capture import AttentionConsumer, LayerAttention, capture_attention
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Encoded, Inspector
from agent_tools.loading import LoadedModel

MAX_NEW_TOKENS = 256
StopReason = Literal["eos", "max_new_tokens"]


def check_new_tokens(value: int) -> int:
    """``max_new_tokens`` in 1..MAX_NEW_TOKENS, or an error naming the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NEW_TOKENS:
        msg = f"max_new_tokens {value!r} out of range 1..{MAX_NEW_TOKENS}"
        raise InvalidInputError(msg, field="max_new_tokens")
    return value


class LastRowConsumer:
    """Keeps, per layer, the attention row of the last query of each layer call: (H, Tk) per layer.

    On the prompt forward that row is the last prompt position; on a KV-cache step it is the new token.
    Call :meth:`take` after each forward to get (L, H, keys) and start afresh. A sliding-window cache holds
    only the most recent keys (the row's keys end at the query itself), so rows are aligned on the right and
    the evicted keys — which the model cannot read — get weight 0.
    """

    def __init__(self, *, batch_index: int = 0) -> None:
        self.batch_index = batch_index
        self._rows: dict[int, Tensor] = {}

    def on_layer(self, layer: LayerAttention) -> None:
        if layer.query_start + layer.weights.shape[2] != layer.query_length:
            return  # this chunk does not hold the call's last query row
        self._rows[layer.layer] = layer.weights[self.batch_index, :, -1, :].float().clone()  # (H, Tk)

    def take(self, keys: int | None = None) -> Tensor:
        """(L, H, keys): each layer's row right-aligned to ``keys`` columns (default: the longest row)."""
        if not self._rows:
            raise RuntimeError("no layer was captured")
        rows = [self._rows[layer] for layer in sorted(self._rows)]
        width = keys if keys is not None else max(row.shape[-1] for row in rows)
        stacked = rows[0].new_zeros(len(rows), rows[0].shape[0], width)  # (L, H, keys)
        for index, row in enumerate(rows):
            if row.shape[-1] > width:
                raise ValueError(f"a row has {row.shape[-1]} keys, more than the {width} asked for")
            stacked[index, :, width - row.shape[-1] :] = row
        self._rows = {}
        return stacked


class ReceivedShareConsumer:
    """What each key receives from the other queries that may read it, summed over heads, rows and layers."""

    def __init__(self, *, batch_index: int = 0) -> None:
        self.batch_index = batch_index
        self.sums: Received | None = None
        self.layers: set[int] = set()

    def on_layer(self, layer: LayerAttention) -> None:
        weights = layer.weights[self.batch_index].float()  # (H, q, Tk)
        allowed = layer.allowed()[self.batch_index, 0]  # (q, Tk)
        positions = torch.arange(weights.shape[1], device=weights.device) + layer.key_index_offset  # (q,)
        received = received_attention(weights, allowed, positions)
        self.sums = received if self.sums is None else self.sums + received
        self.layers.add(layer.layer)

    def received(self) -> Received:
        """Sums over layers, with ``readers`` averaged over the layers (rows that could read each key)."""
        if self.sums is None:
            raise RuntimeError("no layer was captured")
        return Received(self.sums.total, self.sums.count, self.sums.uniform, self.sums.readers / len(self.layers))


@dataclass(frozen=True)
class Generation:
    """What a greedy run produced: the new token ids, why it stopped, the first-step logits and timings."""

    prompt_length: int
    token_ids: list[int]
    stopped: StopReason
    first_logits: Tensor  # (V,) next-token logits at the last prompt position
    prompt_seconds: float
    step_seconds: list[float]  # one per KV-cache step (tokens after the first)

    @property
    def seconds_per_token(self) -> float | None:
        return sum(self.step_seconds) / len(self.step_seconds) if self.step_seconds else None


def stop_token_ids(loaded: LoadedModel) -> set[int]:
    """The EOS ids of the tokenizer and of the model's generation config."""
    ids: set[int] = set()
    candidates = [getattr(loaded.tokenizer, "eos_token_id", None)]
    config = getattr(loaded.model, "generation_config", None)
    candidates.append(getattr(config, "eos_token_id", None) if config is not None else None)
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _cache_argument(model: torch.nn.Module) -> str:
    """transformers 5 calls the KV cache ``cache``; older families ``past_key_values``."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _returned_cache(output: object) -> object:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def answer_forward(
    inspector: Inspector, loaded: LoadedModel, encoded: Encoded, consumers: Sequence[AttentionConsumer]
) -> Tensor | None:
    """One captured forward of the prompt; returns the (V,) next-token logits at its last position (None for
    a model without a next-token head). Only the last position's logits are computed (not T × V)."""
    extra = {"logits_to_keep": 1} if loaded.facts.is_language_model else {}
    chunk = inspector.query_chunk(loaded, encoded.length)
    with (
        loaded.lock,
        torch.inference_mode(),
        capture_attention(loaded.model, consumers, query_chunk=chunk),
    ):
        output = loaded.model(input_ids=encoded.input_ids, attention_mask=encoded.attention_mask, **extra)
    logits = getattr(output, "logits", None)
    return logits[0, -1].float().clone() if extra and logits is not None else None


def greedy_generate(
    inspector: Inspector,
    loaded: LoadedModel,
    encoded: Encoded,
    *,
    max_new_tokens: int,
    prompt_consumers: Sequence[AttentionConsumer] = (),
    step_consumers: Sequence[AttentionConsumer] = (),
    on_step: Callable[[int, int], None] | None = None,
) -> Generation:
    """Generate greedily (argmax) with the KV cache, capturing attention on the prompt and on every step.

    Args:
        inspector: gives the token limit and the query chunking of the prompt forward.
        loaded: a language model (it must have a next-token head).
        encoded: the prompt, batch of one, no padding.
        max_new_tokens: 1..MAX_NEW_TOKENS; generation also stops after an EOS token (which is kept).
        prompt_consumers: see every layer of the prompt forward (all rows).
        step_consumers: see every layer of the prompt forward and of every KV-cache step.
        on_step: called as ``on_step(step, token_id)`` after the forward that chose token ``step`` (step 0 is
            chosen at the last prompt position, step n at position prompt_length - 1 + n, reading that many
            + 1 keys), while the step consumers still hold that forward's rows.
    """
    check_new_tokens(max_new_tokens)
    if not loaded.facts.is_language_model:
        msg = f"model {loaded.name!r} has no next-token head, so it cannot generate; use target='last'"
        raise InvalidInputError(msg, field="target")
    limit = inspector.limit_for(loaded)
    if encoded.length + max_new_tokens > limit:
        msg = (
            f"prompt of {encoded.length} tokens + max_new_tokens {max_new_tokens} exceeds {limit} tokens for "
            f"{loaded.name!r}; use max_new_tokens <= {max(limit - encoded.length, 0)}"
        )
        raise ResourceLimitError(msg, field="max_new_tokens")
    model = loaded.model
    stops = stop_token_ids(loaded)
    cache_name = _cache_argument(model)
    chunk = inspector.query_chunk(loaded, encoded.length)
    token_ids: list[int] = []
    step_seconds: list[float] = []
    stopped: StopReason = "max_new_tokens"
    with loaded.lock, torch.inference_mode():
        start = time.perf_counter()
        with capture_attention(model, [*prompt_consumers, *step_consumers], query_chunk=chunk):
            output = model(input_ids=encoded.input_ids, use_cache=True, logits_to_keep=1)
        prompt_seconds = time.perf_counter() - start
        first_logits = output.logits[0, -1].float().clone()  # (V,)
        token = int(first_logits.argmax())
        token_ids.append(token)
        if on_step is not None:
            on_step(0, token)
        cache = _returned_cache(output)
        with capture_attention(model, list(step_consumers)):
            while token not in stops and len(token_ids) < max_new_tokens:
                start = time.perf_counter()
                step_input = torch.tensor([[token]], dtype=encoded.input_ids.dtype)  # (1, 1)
                output = model(input_ids=step_input, use_cache=True, logits_to_keep=1, **{cache_name: cache})
                cache = _returned_cache(output)
                token = int(output.logits[0, -1].argmax())
                step_seconds.append(time.perf_counter() - start)
                token_ids.append(token)
                if on_step is not None:
                    on_step(len(token_ids) - 1, token)
        if token in stops:
            stopped = "eos"
    return Generation(
        prompt_length=encoded.length,
        token_ids=token_ids,
        stopped=stopped,
        first_logits=first_logits,
        prompt_seconds=prompt_seconds,
        step_seconds=step_seconds,
    )
