"""Attention with chosen heads restricted to a short KV cache: the first ``sink`` keys and the last ``window`` keys.

A streaming head (DuoAttention, Xiao et al. 2024) is served from a cache that keeps only the attention-sink tokens
and a recent window. Whether a head can be served that way is measured exactly by running the model with the head
allowed to read only those keys: query position ``i`` of a restricted head may read key ``j`` when the model's own
mask allows it **and** ``j < sink`` or ``i − window < j`` (the ``window`` most recent keys, itself included). Rows
with ``i < sink + window`` read every earlier key either way, so they are unchanged.

We register one attention function in transformers' ``AttentionInterface`` (the model's own sdpa math for every
head) and switch a model to it only inside :func:`heads_restricted`; the previous implementation is restored in
``finally``. For each restricted (batch row, query head) the function recomputes that head's output over its
allowed keys with the eager math (float32 softmax), query rows in chunks, each scoring only the keys its rows may
read (the sink and the chunk's windows), and writes it over the sdpa output. A batch row may restrict different
heads than its neighbours (row ``b`` of a layer's batch restricts head ``b``), which is how ``plan_kv_cache``
measures every head of a layer in one pass.

Families whose scores carry terms sdpa does not take here (soft-capping, sink logits, relative position bias) and
families routed by an adapter are refused: a restricted layer the function never saw raises, so a restriction is
never silently ignored.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from agent_tools.capture import attention_implementation, attention_scale, repeat_kv, sdpa_forward
from agent_tools.errors import UnsupportedModelError
from agent_tools.families import find_attention_modules

RESTRICTED_IMPLEMENTATION = "attention_explainer_restricted"
_REFUSED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias", "attention_sinks", "alibi")
_CHUNK_FLOATS = 1 << 24  # scores held per chunk of query rows (64 MiB in float32)

# layer -> [(batch row, query heads restricted in that row)]
Restrictions = Mapping[int, Sequence[tuple[int, Sequence[int]]]]


@dataclass
class _RestrictedState:
    layers: dict[int, int]  # id(attention module) -> layer index
    restrictions: Restrictions
    sink: int
    window: int
    seen: set[int] = field(default_factory=set)  # restricted layers the function ran


_ACTIVE: contextvars.ContextVar[_RestrictedState | None] = contextvars.ContextVar("restricted", default=None)


def short_cache_allowed(
    positions: Tensor, keys: int, *, sink: int, window: int, columns: Tensor | None = None
) -> Tensor:
    """(q,) query positions -> (q, keys) bool: key j < sink, or positions[i] − window < j ≤ positions[i].
    ``columns`` (n,): only those keys, (q, n)."""
    if columns is None:
        columns = torch.arange(keys, device=positions.device)
    rows = positions[:, None]  # (q, 1)
    return (columns[None, :] <= rows) & ((columns[None, :] < sink) | (columns[None, :] > rows - window))


def _short_cache_keys(first: int, stop: int, keys: int, *, sink: int, window: int, device: torch.device) -> Tensor:
    """The keys the query positions ``first..stop−1`` may read on the short cache, sorted: the sink and the span from
    ``first − window + 1`` to ``stop − 1`` (every other key is masked for all of them)."""
    low = max(sink, first - window + 1)
    return torch.cat([torch.arange(min(sink, keys), device=device), torch.arange(low, min(stop, keys), device=device)])


def _base_allowed(mask: Tensor | None, batch: int, rows: int, keys: int, device: torch.device) -> Tensor:
    """(B, q, Tk) bool: what the model's own mask lets each query read (None: causal, queries last)."""
    if mask is None:
        positions = torch.arange(keys - rows, keys, device=device)
        causal = torch.arange(keys, device=device)[None, :] <= positions[:, None]
        return causal[None].expand(batch, rows, keys)
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    mask = mask[..., :keys]  # (B or 1, 1, q or 1, Tk)
    return mask[:, 0].expand(batch, rows, keys)


def _restricted_heads(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    allowed: Tensor,
    pairs: Sequence[tuple[int, int]],
    scaling: float,
    *,
    sink: int,
    window: int,
) -> tuple[Tensor, int]:
    """The outputs (P, q', D) of the restricted (row, head) ``pairs`` over the query rows that lose keys.

    ``query`` (B, H, q, D), ``key``/``value`` (B, H, Tk, D) already expanded per query head, ``allowed`` (B, q, Tk)
    the model's mask. Returns the outputs of rows ``first..q−1`` and ``first``, the first row whose position is at
    least ``sink + window`` (earlier rows read every earlier key either way).

    A chunk of query rows scores only the keys some row of it may read (the sink and the chunk's span of windows,
    :func:`_short_cache_keys`): the keys left out are masked for every row of the chunk, so they would add exact
    zeros to the softmax and to the weighted sum. The work is ``P·q·(sink + window + chunk)``, not ``P·q·Tk``.
    """
    rows, keys = query.shape[2], key.shape[2]
    offset = keys - rows  # key column of query row 0
    first = max(0, sink + window - offset)
    rows_b = torch.tensor([b for b, _ in pairs], device=query.device)
    heads_h = torch.tensor([h for _, h in pairs], device=query.device)
    q = query[rows_b, heads_h, first:].float()  # (P, q', D)
    k = key[rows_b, heads_h].float()  # (P, Tk, D)
    v = value[rows_b, heads_h].float()  # (P, Tk, D)
    # c rows score at most sink + window + c keys, so q rows cost q·(sink + window + c): c about sink + window (at
    # least 64 rows), and at most the largest c with P·c·(sink + window + c) <= _CHUNK_FLOATS
    span, per_pair = sink + window, _CHUNK_FLOATS // max(1, len(pairs))
    chunk = max(1, min(max(64, span), (math.isqrt(span * span + 4 * per_pair) - span) // 2))
    outputs = []
    for start in range(first, rows, chunk):
        stop = min(start + chunk, rows)
        positions = torch.arange(offset + start, offset + stop, device=query.device)
        columns = _short_cache_keys(offset + start, offset + stop, keys, sink=sink, window=window, device=query.device)
        short = short_cache_allowed(positions, keys, sink=sink, window=window, columns=columns)  # (c, n)
        mask = allowed[rows_b, start:stop][:, :, columns] & short[None]  # (P, c, n)
        scores = torch.matmul(q[:, start - first : stop - first], k[:, columns].transpose(-1, -2)) * scaling
        scores = scores.masked_fill(~mask, float("-inf"))  # (P, c, n)
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no allowed key writes 0
        outputs.append(torch.matmul(weights, v[:, columns]))  # (P, c, D)
    if not outputs:
        return q.new_zeros(len(pairs), 0, q.shape[-1]), first
    return torch.cat(outputs, dim=1), first


def restricted_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The registered function: the model's sdpa attention, with the active restrictions written over it."""
    refused = [name for name in _REFUSED_KWARGS if kwargs.get(name) is not None]
    if refused:
        msg = (
            f"{type(module).__name__} passes {', '.join(refused)} to its attention; the short-cache restriction "
            "reproduces plain softmax(q·kᵀ·scale + mask) attention only"
        )
        raise UnsupportedModelError(msg)
    scaling = attention_scale(module, query, scaling)
    output, _ = sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    state = _ACTIVE.get()
    layer = state.layers.get(id(module)) if state is not None else None
    if state is None or layer is None or layer not in state.restrictions:
        return output, None
    state.seen.add(layer)
    pairs = [(row, head) for row, heads in state.restrictions[layer] for head in heads]
    if not pairs:
        return output, None
    batch, rows = query.shape[0], query.shape[2]
    groups = query.shape[1] // key.shape[1]
    key_states, value_states = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, Tk, D)
    allowed = _base_allowed(attention_mask, batch, rows, key_states.shape[2], query.device)
    restricted, first = _restricted_heads(
        query, key_states, value_states, allowed, pairs, float(scaling), sink=state.sink, window=state.window
    )
    if restricted.shape[1]:
        output = output.clone()
        for index, (row, head) in enumerate(pairs):
            output[row, first:, head] = restricted[index].to(output.dtype)
    return output, None


AttentionInterface.register(RESTRICTED_IMPLEMENTATION, restricted_attention_forward)
AttentionMaskInterface.register(RESTRICTED_IMPLEMENTATION, sdpa_mask)


@contextmanager
def heads_restricted(
    model: nn.Module, restrictions: Restrictions, *, sink: int, window: int
) -> Iterator[_RestrictedState]:
    """Inside the block, the model's forwards restrict the named heads to the first ``sink`` and last ``window`` keys.

    Args:
        model: a model whose family routes attention through transformers' attention interface.
        restrictions: layer -> [(batch row, query heads)]: in that layer, those heads of that row of the batch read
            only the short cache (a layer may restrict different heads in different rows).
        sink, window: the short cache: keys ``j < sink`` and the ``window`` most recent keys.

    After the block (when no error unwound it) every restricted layer must have run through the function; a family
    that computes attention elsewhere raises :class:`UnsupportedModelError` instead of returning unrestricted numbers.
    """
    modules = find_attention_modules(model)
    state = _RestrictedState(
        layers={id(module): index for index, module in enumerate(modules)},
        restrictions=restrictions,
        sink=sink,
        window=window,
    )
    with attention_implementation(model, RESTRICTED_IMPLEMENTATION, active=(_ACTIVE, state)):
        yield state
    missed = sorted(set(restrictions) - state.seen)
    if missed:
        msg = (
            f"{type(model).__name__} computed attention of layer(s) {missed} outside the attention interface, so "
            "their heads could not be restricted to a short cache"
        )
        raise UnsupportedModelError(msg)
