"""Captured forward passes: the prompt through the model with capture on, inputs on the model's device."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from agent_tools.capture import AttentionConsumer, StopCapture, capture_attention
from agent_tools.errors import InvalidInputError
from agent_tools.loading import LoadedModel


def on_device(loaded: LoadedModel, tensor: Tensor) -> Tensor:
    """A tokenised input moved to the model's input device (with a device map, accelerate moves the rest)."""
    return tensor if tensor.device == loaded.device else tensor.to(loaded.device)


def float_embeddings(loaded: LoadedModel, refusal: str, field: str) -> torch.nn.Module:
    """The input embedding module when gradients can start there (a floating-point table); a quantized or missing
    one is refused with ``refusal`` (naming ``field``)."""
    lookup = getattr(loaded.model, "get_input_embeddings", None)
    embeddings = lookup() if callable(lookup) else None
    weight = getattr(embeddings, "weight", None)
    if not (isinstance(embeddings, torch.nn.Module) and isinstance(weight, Tensor) and weight.is_floating_point()):
        raise InvalidInputError(refusal, field=field)
    return embeddings


def _mask_on_device(loaded: LoadedModel, mask: Tensor | None) -> Tensor | None:
    return None if mask is None else on_device(loaded, mask)


LOCK_POLL_SECONDS = 0.1  # how often a call waiting for the model's lock looks at its checkpoint


@contextmanager
def locked(loaded: LoadedModel, checkpoint: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the model's lock for the block; while waiting for it, call ``checkpoint`` every 0.1 s.

    In a server every call queues on one model: a call cancelled (or past its deadline) while it waits must leave
    the queue at once instead of running after the client has gone. ``checkpoint`` runs once more after the lock
    is taken, so a call stopped while waiting never starts its pass. The lock is re-entrant: a runner function
    called inside this block takes it again without waiting.
    """
    if checkpoint is None:
        with loaded.lock:
            yield
        return
    while not loaded.lock.acquire(timeout=LOCK_POLL_SECONDS):
        checkpoint()
    try:
        checkpoint()
        yield
    finally:
        loaded.lock.release()


def captured_forward(
    loaded: LoadedModel,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    consumers: Sequence[AttentionConsumer],
    *,
    stack: str | None = None,
    decoder_input_ids: Tensor | None = None,
    layers: Sequence[int] | None = None,
    query_chunk: int | None = None,
    record_inputs: bool = False,
    need_output: bool = True,
    checkpoint: Callable[[], None] | None = None,
) -> Any:
    """One forward pass with capture of one attention ``stack`` (None = the model's default); returns the model's
    output (None when ``need_output`` is False).

    With ``need_output=False`` (the caller only wants what its consumers collect) the pass skips the
    language-model head and stops right after the last captured layer. ``checkpoint`` (the call's cancel and
    deadline check) runs while waiting for the lock, before every layer and between query chunks.

    An encoder–decoder's encoder stack runs the encoder alone (its output is the encoder's); the decoder and cross
    stacks run the whole model with ``decoder_input_ids`` (1, n), what the decoder reads.
    """
    input_ids, attention_mask = on_device(loaded, input_ids), _mask_on_device(loaded, attention_mask)
    if loaded.facts.is_encoder_decoder and decoder_input_ids is None and stack not in (None, "encoder"):
        raise ValueError(f"the {stack} stack of an encoder–decoder needs decoder_input_ids")
    model, extra = stack_runner(loaded, decoder_input_ids)
    if not need_output and model is loaded.model:
        base = getattr(model, "base_model", None)
        model = base if isinstance(base, torch.nn.Module) else model
    with (
        locked(loaded, checkpoint),
        torch.inference_mode(),
        capture_attention(
            loaded.model,
            consumers,
            stack=stack,
            layers=layers,
            query_chunk=query_chunk,
            record_inputs=record_inputs,
            stop_after_last=not need_output,
            checkpoint=checkpoint,
        ),
    ):
        try:
            output = model(input_ids=input_ids, attention_mask=attention_mask, **extra)
        except StopCapture:
            return None
        return output if need_output else None


def stack_runner(loaded: LoadedModel, decoder_input_ids: Tensor | None) -> tuple[torch.nn.Module, dict[str, Any]]:
    """What a pass runs and the arguments it adds: an encoder–decoder without ``decoder_input_ids`` runs its
    encoder alone; with them (1, n) the whole model reads them on its decoder side."""
    if loaded.facts.is_encoder_decoder and decoder_input_ids is None:
        return encoder_of(loaded), {}
    if decoder_input_ids is not None:
        return loaded.model, {"decoder_input_ids": on_device(loaded, decoder_input_ids)}
    return loaded.model, {}


def encoder_of(loaded: LoadedModel) -> torch.nn.Module:
    """An encoder–decoder's encoder (what its encoder stack runs through)."""
    get_encoder = getattr(loaded.model, "get_encoder", None)
    encoder = get_encoder() if callable(get_encoder) else None
    if not isinstance(encoder, torch.nn.Module):
        raise ValueError(f"{type(loaded.model).__name__} has no get_encoder()")
    return encoder


def answer_logits(
    loaded: LoadedModel,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    consumers: Sequence[AttentionConsumer],
    *,
    query_chunk: int | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> Tensor | None:
    """One captured forward of a prompt; returns the (V,) next-token logits at its last position (None for a
    model without a next-token head). Only the last position's logits are computed (``logits_to_keep=1``)."""
    extra = {"logits_to_keep": 1} if loaded.facts.is_language_model else {}
    input_ids, attention_mask = on_device(loaded, input_ids), _mask_on_device(loaded, attention_mask)
    capture = capture_attention(loaded.model, consumers, query_chunk=query_chunk, checkpoint=checkpoint)
    with locked(loaded, checkpoint), torch.inference_mode(), capture:
        output = loaded.model(input_ids=input_ids, attention_mask=attention_mask, **extra)
    logits = getattr(output, "logits", None)
    return logits[0, -1].float().clone() if extra and logits is not None else None


def model_output(output: Any) -> tuple[Tensor, bool]:
    """The logits of a language model, else the last hidden states; and which of the two it is."""
    logits = getattr(output, "logits", None)
    return (logits, True) if logits is not None else (output.last_hidden_state, False)
