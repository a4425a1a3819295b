"""Greedy generation with the KV cache under capture, one step at a time."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from agent_tools.capture import AttentionConsumer, capture_attention, layer_checkpoints
from agent_tools.errors import UnsupportedModelError
from agent_tools.loading import LoadedModel
from agent_tools.runner.forward import _mask_on_device, encoder_of, locked, on_device

StopReason = Literal["eos", "max_new_tokens", "line", "sentence"]
StopRule = Callable[[list[int]], StopReason | None]  # token ids so far -> why to stop now (None: go on)


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


def cache_layers(output: object) -> list[tuple[Tensor, Tensor]] | None:
    """Per layer the (B, Hkv, T, D) keys and values of the KV cache a forward returned (None: not a cache whose
    layers hold plain tensors, so it cannot be sliced and reused)."""
    layers = getattr(_returned_cache(output), "layers", None)
    if not layers or not all(isinstance(getattr(layer, "keys", None), Tensor) for layer in layers):
        return None
    return [(layer.keys, layer.values) for layer in layers]


def cache_of(layers: list[tuple[Tensor, Tensor]], rows: int | Sequence[int], length: int | None = None) -> object:
    """A fresh KV cache of :func:`cache_layers`' keys and values (their first ``length`` positions; None: all) with
    ``rows`` copies of row 0 at every layer (a sequence: at each layer its own count)."""
    from transformers import DynamicCache

    counts = [rows] * len(layers) if isinstance(rows, int) else rows
    data = [
        (k[:, :, :length].expand(n, -1, -1, -1).contiguous(), v[:, :, :length].expand(n, -1, -1, -1).contiguous())
        for (k, v), n in zip(layers, counts, strict=True)
    ]
    return DynamicCache(ddp_cache_data=data)


def greedy_generate(
    loaded: LoadedModel,
    input_ids: Tensor,
    *,
    max_new_tokens: int,
    query_chunk: int | None = None,
    prompt_consumers: Sequence[AttentionConsumer] = (),
    step_consumers: Sequence[AttentionConsumer] = (),
    on_step: Callable[[int, int], None] | None = None,
    checkpoint: Callable[[], None] | None = None,
    stop_when: StopRule | None = None,
) -> Generation:
    """Generate greedily (argmax) with the KV cache, capturing attention on the prompt and on every step.

    The prompt goes through the model once (query-chunked like any captured forward); then each new token is
    fed alone with the cache, so every step's layer call has one query row and ``past + 1`` keys. Generation
    stops after ``max_new_tokens`` or an EOS token (which is kept). The caller validated the limits.

    Args:
        loaded: a language model (it must have a next-token head).
        input_ids: (1, T) the prompt, no padding.
        prompt_consumers: see every layer of the prompt forward (all rows).
        step_consumers: see every layer of the prompt forward and of every KV-cache step.
        on_step: called as ``on_step(step, token_id)`` after the forward that chose token ``step`` (step 0 is
            chosen at the last prompt position, step n at position prompt_length - 1 + n, reading that many
            + 1 keys), while the step consumers still hold that forward's rows.
        checkpoint: the call's cancel and deadline check; it runs while waiting for the lock, before every layer
            (prompt and steps) and between steps, and raises to stop the generation.
        stop_when: called with the token ids so far after every token; a reason (e.g. "line") stops the
            generation there (the token is kept), None goes on. EOS and ``max_new_tokens`` always stop.
    """
    input_ids = on_device(loaded, input_ids)
    model = loaded.model
    cache_name = _cache_argument(model)

    def step(token_input: Tensor, cache: object) -> Any:
        return model(input_ids=token_input, use_cache=True, logits_to_keep=1, **{cache_name: cache})

    with locked(loaded, checkpoint), torch.inference_mode():
        start = time.perf_counter()
        consumers = [*prompt_consumers, *step_consumers]
        with capture_attention(model, consumers, query_chunk=query_chunk, checkpoint=checkpoint):
            output = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        prompt_seconds = time.perf_counter() - start
        with capture_attention(model, list(step_consumers), checkpoint=checkpoint):
            return _greedy_steps(
                loaded, input_ids, output, step, prompt_seconds=prompt_seconds, max_new_tokens=max_new_tokens,
                checkpoint=checkpoint, stop_when=stop_when, on_step=on_step,
            )  # fmt: skip


def _greedy_steps(
    loaded: LoadedModel,
    input_ids: Tensor,
    output: Any,
    step: Callable[[Tensor, object], Any],
    *,
    prompt_seconds: float,
    max_new_tokens: int,
    checkpoint: Callable[[], None] | None,
    stop_when: StopRule | None,
    on_step: Callable[[int, int], None] | None = None,
) -> Generation:
    """The answer from the prompt's forward ``output`` on: argmax tokens, each fed alone to ``step(token (1, 1),
    cache)`` with the cache the previous forward returned, until EOS, ``stop_when``'s reason or ``max_new_tokens``
    (see :func:`greedy_generate`)."""
    stops = stop_token_ids(loaded)
    step_seconds: list[float] = []
    first_logits = output.logits[0, -1].float().clone()  # (V,)
    token = int(first_logits.argmax())
    token_ids = [token]
    if on_step is not None:
        on_step(0, token)
    cache = _returned_cache(output)
    rule_stop = stop_when(token_ids) if stop_when is not None and token not in stops else None
    while token not in stops and rule_stop is None and len(token_ids) < max_new_tokens:
        if checkpoint is not None:
            checkpoint()  # between steps, before the next token's forward
        start = time.perf_counter()
        output = step(torch.tensor([[token]], dtype=input_ids.dtype, device=input_ids.device), cache)  # (1, 1)
        cache = _returned_cache(output)
        token = int(output.logits[0, -1].argmax())
        step_seconds.append(time.perf_counter() - start)
        token_ids.append(token)
        if on_step is not None:
            on_step(len(token_ids) - 1, token)
        if stop_when is not None and token not in stops:
            rule_stop = stop_when(token_ids)
    stopped: StopReason = "eos" if token in stops else rule_stop if rule_stop is not None else "max_new_tokens"
    return Generation(
        prompt_length=int(input_ids.shape[-1]),
        token_ids=token_ids,
        stopped=stopped,
        first_logits=first_logits,
        prompt_seconds=prompt_seconds,
        step_seconds=step_seconds,
    )


def decoder_start_id(loaded: LoadedModel) -> int:
    """The token an encoder–decoder's decoder starts from (generation config, then config, then pad)."""
    config = getattr(loaded.model, "config", None)
    for source in (getattr(loaded.model, "generation_config", None), config):
        value = getattr(source, "decoder_start_token_id", None) if source is not None else None
        if isinstance(value, int):
            return value
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, int):
        return pad
    raise UnsupportedModelError(f"{loaded.name!r} names no decoder_start_token_id: its decoder cannot start")


def seq2seq_generate(
    loaded: LoadedModel,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    *,
    max_new_tokens: int,
    checkpoint: Callable[[], None] | None = None,
    stop_when: StopRule | None = None,
) -> Generation:
    """An encoder–decoder's greedy (argmax) answer: the encoder once, then one decoder step per token on the cache.

    No capture (the model's own attention): the maps of the answer come from one teacher-forced pass over it
    (``captured_forward`` with ``decoder_input_ids``), which computes the same rows. Stops after
    ``max_new_tokens``, an EOS token (kept) or when ``stop_when`` gives a reason. ``prompt_length`` is the encoder
    input's length.
    """
    input_ids, attention_mask = on_device(loaded, input_ids), _mask_on_device(loaded, attention_mask)
    model = loaded.model
    cache_name = _cache_argument(model)
    with locked(loaded, checkpoint), torch.inference_mode(), layer_checkpoints(model, checkpoint):
        start = time.perf_counter()
        encoder_outputs = encoder_of(loaded)(input_ids=input_ids, attention_mask=attention_mask)

        def step(token_input: Tensor, cache: object = None) -> Any:
            cached = {} if cache is None else {cache_name: cache}
            return model(
                encoder_outputs=encoder_outputs, attention_mask=attention_mask, decoder_input_ids=token_input,
                use_cache=True, **cached,
            )  # fmt: skip

        output = step(torch.tensor([[decoder_start_id(loaded)]], dtype=input_ids.dtype, device=input_ids.device))
        prompt_seconds = time.perf_counter() - start
        return _greedy_steps(
            loaded, input_ids, output, step, prompt_seconds=prompt_seconds, max_new_tokens=max_new_tokens,
            checkpoint=checkpoint, stop_when=stop_when,
        )  # fmt: skip
