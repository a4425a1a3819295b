"""Every forward pass of the model: captured passes, greedy generation, and head-ablated passes.

Only this module calls a model's ``forward``; the :class:`~agent_tools.inspector.Inspector` validates the
request (token limits, budgets, indices) and calls these functions, and tools call the inspector. Each
function holds the model's lock for the whole pass and runs under ``torch.inference_mode``; hooks live only
inside the context managers of :mod:`agent_tools.capture` and :mod:`agent_tools.intervene`, removed in
``finally``.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from agent_tools.capture import AttentionConsumer, StopCapture, capture_attention
from agent_tools.intervene import AblationMethod, group_heads, heads_ablated, recorded_head_means
from agent_tools.loading import LoadedModel

StopReason = Literal["eos", "max_new_tokens"]


def on_device(loaded: LoadedModel, tensor: Tensor) -> Tensor:
    """A tokenised input moved to the model's input device (with a device map, accelerate moves the rest)."""
    return tensor if tensor.device == loaded.device else tensor.to(loaded.device)


def _mask_on_device(loaded: LoadedModel, mask: Tensor | None) -> Tensor | None:
    return None if mask is None else on_device(loaded, mask)


def captured_forward(
    loaded: LoadedModel,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    consumers: Sequence[AttentionConsumer],
    *,
    layers: Sequence[int] | None = None,
    query_chunk: int | None = None,
    record_inputs: bool = False,
    need_output: bool = True,
) -> Any:
    """One forward pass with capture; returns the model's output (None when ``need_output`` is False).

    With ``need_output=False`` (the caller only wants what its consumers collect) the pass skips the
    language-model head and stops right after the last captured layer.
    """
    input_ids, attention_mask = on_device(loaded, input_ids), _mask_on_device(loaded, attention_mask)
    model = loaded.model
    if not need_output:
        base = getattr(model, "base_model", None)
        model = base if isinstance(base, torch.nn.Module) else model
    with (
        loaded.lock,
        torch.inference_mode(),
        capture_attention(
            loaded.model,
            consumers,
            layers=layers,
            query_chunk=query_chunk,
            record_inputs=record_inputs,
            stop_after_last=not need_output,
        ),
    ):
        try:
            output = model(input_ids=input_ids, attention_mask=attention_mask)
        except StopCapture:
            return None
        return output if need_output else None


def answer_logits(
    loaded: LoadedModel,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    consumers: Sequence[AttentionConsumer],
    *,
    query_chunk: int | None = None,
) -> Tensor | None:
    """One captured forward of a prompt; returns the (V,) next-token logits at its last position (None for a
    model without a next-token head). Only the last position's logits are computed (``logits_to_keep=1``)."""
    extra = {"logits_to_keep": 1} if loaded.facts.is_language_model else {}
    input_ids, attention_mask = on_device(loaded, input_ids), _mask_on_device(loaded, attention_mask)
    with loaded.lock, torch.inference_mode(), capture_attention(loaded.model, consumers, query_chunk=query_chunk):
        output = loaded.model(input_ids=input_ids, attention_mask=attention_mask, **extra)
    logits = getattr(output, "logits", None)
    return logits[0, -1].float().clone() if extra and logits is not None else None


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


def greedy_generate(
    loaded: LoadedModel,
    input_ids: Tensor,
    *,
    max_new_tokens: int,
    query_chunk: int | None = None,
    prompt_consumers: Sequence[AttentionConsumer] = (),
    step_consumers: Sequence[AttentionConsumer] = (),
    on_step: Callable[[int, int], None] | None = None,
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
    """
    input_ids = on_device(loaded, input_ids)
    model = loaded.model
    stops = stop_token_ids(loaded)
    cache_name = _cache_argument(model)
    token_ids: list[int] = []
    step_seconds: list[float] = []
    stopped: StopReason = "max_new_tokens"
    with loaded.lock, torch.inference_mode():
        start = time.perf_counter()
        with capture_attention(model, [*prompt_consumers, *step_consumers], query_chunk=query_chunk):
            output = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
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
                step_input = torch.tensor([[token]], dtype=input_ids.dtype, device=input_ids.device)  # (1, 1)
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
        prompt_length=int(input_ids.shape[-1]),
        token_ids=token_ids,
        stopped=stopped,
        first_logits=first_logits,
        prompt_seconds=prompt_seconds,
        step_seconds=step_seconds,
    )


@dataclass(frozen=True)
class AblationEffect:
    """Clean vs ablated outputs of one input, as tensors for the service layer (never returned by a tool)."""

    clean: Tensor  # (B, T, V) logits or (B, T, C) hidden states
    ablated: Tensor
    language_model: bool


def model_output(output: Any) -> tuple[Tensor, bool]:
    """The logits of a language model, else the last hidden states; and which of the two it is."""
    logits = getattr(output, "logits", None)
    return (logits, True) if logits is not None else (output.last_hidden_state, False)


def ablated_forward(
    loaded: LoadedModel,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    heads: Sequence[tuple[int, int]],
    *,
    method: AblationMethod = "zero",
    clean: Tensor | None = None,
) -> AblationEffect:
    """Clean (unless given) and ablated forwards with the model's own attention implementation, under its lock."""
    facts = loaded.facts
    input_ids, attention_mask = on_device(loaded, input_ids), _mask_on_device(loaded, attention_mask)
    grouped = group_heads(heads)
    model = loaded.model
    with loaded.lock, torch.inference_mode():
        means = None
        if clean is None or method == "mean":
            with recorded_head_means(
                model,
                list(grouped) if method == "mean" else [],
                num_heads=facts.num_heads,
                head_dim=facts.head_dim,
                attention_mask=attention_mask,
            ) as recorded:
                clean_out, is_lm = model_output(model(input_ids=input_ids, attention_mask=attention_mask))
            clean = clean if clean is not None else clean_out
            means = dict(recorded)
        with heads_ablated(
            model, grouped, num_heads=facts.num_heads, head_dim=facts.head_dim, method=method, means=means
        ):
            ablated, is_lm = model_output(model(input_ids=input_ids, attention_mask=attention_mask))
    return AblationEffect(clean=clean, ablated=ablated, language_model=is_lm)
