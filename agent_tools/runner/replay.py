"""One layer's attention run again from its recorded call, without the layers before it.

The ``analyze`` job captures every layer in a first pass, then looks closer at the most collapsed head — a layer
known only after that pass. A second forward would recompute every layer up to it (most of a forward at 2,048
tokens). Instead the first pass keeps each attention module's call (its arguments, by reference: the hidden
states entering it, the rotary (cos, sin), the mask), and :func:`replayed_layer` calls that one module again under
capture: its consumers see exactly what a fresh pass up to that layer would hand them (the same tensors, the same
attention function). The KV cache argument is dropped, so the replay neither reads nor extends a cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from agent_tools.capture import AttentionConsumer, called_hidden_states, capture_attention, hooks_registered
from agent_tools.families import find_attention_modules
from agent_tools.loading import LoadedModel
from agent_tools.runner.forward import locked

RecordedCalls = dict[int, tuple[tuple[Any, ...], dict[str, Any]]]  # layer -> (args, kwargs) of its module's call
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache", "layer_past")


@contextmanager
def recorded_attention_calls(loaded: LoadedModel, *, limit_bytes: int) -> Iterator[RecordedCalls]:
    """Inside the block, the first call of each of the default stack's attention modules is kept (by reference) in
    the dict yielded, while the hidden states kept stay within ``limit_bytes``; the hooks are removed in
    ``finally``. Later passes inside the block (other inputs, e.g. a probe) are not kept."""
    calls: RecordedCalls = {}
    held = [0]

    def hook_for(layer: int) -> Callable[[torch.nn.Module, tuple, dict], None]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = called_hidden_states(args, kwargs)
            size = hidden.numel() * hidden.element_size() if hidden is not None else 0
            if layer not in calls and hidden is not None and held[0] + size <= limit_bytes:  # the block's first pass
                calls[layer] = (args, dict(kwargs))
                held[0] += size

        return hook

    modules = find_attention_modules(loaded.model)
    with hooks_registered(m.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, m in enumerate(modules)):
        yield calls


def replayed_layer(
    loaded: LoadedModel,
    calls: RecordedCalls,
    layer: int,
    consumers: Sequence[AttentionConsumer],
    *,
    input_shape: Sequence[int],
    query_chunk: int | None = None,
    record_inputs: bool = False,
    checkpoint: Callable[[], None] | None = None,
) -> bool:
    """Layer ``layer``'s attention module called again on its recorded call, with capture of that layer only.

    ``input_shape``: the (B, T) of the plans' tokens; a call recorded on other tokens is not replayed. Returns False
    (nothing run) when the call was not recorded; the caller then runs a forward pass instead.
    """
    if layer not in calls:
        return False
    args, kwargs = calls[layer]
    hidden = called_hidden_states(args, kwargs)
    if hidden is None or hidden.shape[:-1] != tuple(input_shape):
        return False  # recorded on other tokens than the plans'

    kwargs = {key: (None if key in _CACHE_ARGUMENTS else value) for key, value in kwargs.items()}
    module = find_attention_modules(loaded.model)[layer]
    capture = capture_attention(
        loaded.model,
        consumers,
        layers=[layer],
        query_chunk=query_chunk,
        record_inputs=record_inputs,
        checkpoint=checkpoint,
    )
    with locked(loaded, checkpoint), torch.inference_mode(), capture:
        module(*args, **kwargs)  # the module's output is not needed: the consumers keep what they want
    return True
