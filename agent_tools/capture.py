"""Exact, streaming capture of every layer's attention through transformers' attention interface.

transformers 5 routes the attention of every modern family through ``ALL_ATTENTION_FUNCTIONS`` with the
signature ``(module, query, key, value, attention_mask, scaling, dropout, **kwargs)``: query and key arrive
after projection *and* after rotary embeddings. We register one function there (with the eager mask
function under the same name) and switch a model to it only inside :func:`capture_attention`; the previous
implementation is restored in ``finally``.

The function computes exactly what the families' eager functions compute (GQA via ``repeat_kv`` layout,
soft-capping, float32 softmax, the additive score terms some families pass — T5's relative position bias as
``position_bias``, an adapter's ALiBi or disentangled terms — and GPT-OSS's per-head sink logits as an extra
softmax column) and hands each layer's tensors to the consumers as a :class:`LayerAttention`, one layer (or one
chunk of query rows) at a time. Nothing is kept unless a consumer keeps it.

A capture covers one attention stack (:mod:`agent_tools.families`: ``"self"``, or ``"encoder"``, ``"decoder"``
and ``"cross"`` of an encoder–decoder); the other stacks' layers run uncaptured with the same math. Families
outside the interface whose :mod:`agent_tools.adapters` adapter routes them (BLOOM, MPT, Falcon, DeBERTa-v2)
call this function through the adapter's forward while the capture is active.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import AttentionInterface

from agent_tools.adapters import adapter_for, float_mask
from agent_tools.errors import InvalidInputError, UnsupportedModelError
from agent_tools.families import (
    RELATIVE_POSITION_BIAS,
    SELF,
    SINK_LOGIT,
    attention_stacks,
    default_stack_name,
    output_head,
)

CAPTURE_IMPLEMENTATION = "attention_explainer_capture"

# Keyword arguments a family could pass that change the attention math in ways we do not reproduce: refused
# rather than returned inexact. (``position_bias`` and the ``s_aux``/``sinks`` sink logits are reproduced.)
_UNSUPPORTED_KWARGS = ("attention_sinks", "alibi")

# Which uncaptured layers may run sdpa instead of the eager math, measured on the 16-layer Llama of
# tests/test_capture.py (60 tokens, random weights, q/k scaled for peaked maps):
# - before the last captured layer: none, in any precision. sdpa rounds differently from eager and the difference
#   reaches every later layer's input: layer 14's map moved by 1.8e-4 in float32 (the promise is 1e-5) and by up to
#   0.99 in bfloat16 (the promise is bit for bit) when the 14 layers before it ran sdpa.
# - after the last captured layer: they reach no captured map, only the pass's output, and run only when the caller
#   reads that output (otherwise the pass stops at the last captured layer). In float32 sdpa keeps the output within
#   2e-5 of the eager pass's. In half precision it does not: with layer 1 captured in bfloat16 the logits moved 0.21
#   from the eager pass's (the model's default sdpa pass is 0.53 away) and the top-1 token changed on 17 % of the
#   positions, so the output would be neither the eager pass the report explains nor the model's default. There
#   they stay eager.
SDPA_AFTER_DTYPES: tuple[torch.dtype, ...] = (torch.float32,)


@dataclass(eq=False)
class LayerAttention:
    """One layer's attention (or one chunk of its query rows), exactly as the model computes it.

    Shapes: ``B`` batch, ``H`` query heads, ``Hkv`` KV heads, ``q`` query rows in this chunk, ``Tk`` keys,
    ``D`` head_dim. Tensors are views the consumer must not modify; copy what you keep. ``logits`` is a buffer
    reused for the next chunk: read it (or the measures derived from it) inside ``on_layer`` only.

    Key columns: ``key``/``value`` always hold every key (``Tk``). The per-row tensors (``weights``, ``logits``,
    ``mask``, ``scores``, ``bias``) hold key columns ``[0, key_width)``; ``key_width < Tk`` only when every consumer
    of the capture declared ``accepts_key_prefix = True`` and no row of the chunk may read a later column (the
    causal part of a chunk): those columns' weights are exactly 0, so nothing is lost by not computing them.

    Stacks: ``stack`` names the attention stack (``"self"``; ``"encoder"``, ``"decoder"`` or ``"cross"`` in an
    encoder–decoder) and ``layer`` is the index within it. For cross-attention, query rows are decoder positions
    and keys/values encoder positions; ``mask`` is the encoder padding mask (no causal part) and
    ``key_index_offset`` has no meaning.

    Score terms: ``terms`` names the additive terms the family puts in the scores and the capture included
    (``"relative position bias"``, ``"ALiBi"``, ``"c2p/p2c"``, ``"sink logit"``). ``bias`` is their sum,
    already inside ``scores`` and ``logits``: scores = q·kᵀ·scaling (soft-capped) + bias; logits = scores + mask.
    With sink logits (GPT-OSS) the softmax has one more column per row, the head's learned ``sink_logits``;
    ``weights`` holds only the real key columns, so its rows sum to 1 − :meth:`sink_share`.
    """

    layer: int
    query: Tensor  # (B, H, q, D) after projection and rotary embeddings
    key: Tensor  # (B, Hkv, Tk, D)
    value: Tensor  # (B, Hkv, Tk, D)
    mask: Tensor | None  # (B, 1, q, Tk) additive: 0 where a key may be read, dtype-min where not
    weights: Tensor  # (B, H, q, Tk) softmax(scores + mask): what the model uses
    scaling: float
    softcap: float | None
    kv_groups: int
    query_start: int  # row of this chunk's first query within the layer call
    query_length: int  # query rows of the whole layer call
    module: nn.Module
    layer_input: Tensor | None = None  # (B, T, C) hidden states entering the attention module
    position_embeddings: tuple[Tensor, Tensor] | None = None  # (cos, sin) for rotary families
    logits: Tensor | None = None  # (B, H, q, Tk) scores + mask, the softmax input (valid during on_layer)
    output: Tensor | None = None  # (B, H, q, D) weights @ value: what each head writes before W_O
    stack: str = SELF  # the attention stack this layer belongs to; ``layer`` counts within it
    terms: tuple[str, ...] = ()  # additive score terms included (see the class docstring)
    bias: Tensor | None = None  # (B or 1, H, q, key_width) the additive terms, already in scores and logits
    sink_logits: Tensor | None = None  # (H,) learned per-head sink logit: an extra softmax column
    sink_weight: Tensor | None = None  # (B, H, q) the softmax weight of the sink column (see sink_share)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def scores(self) -> Tensor:
        """(B, H, q, Tk) q·kᵀ·scaling, soft-capped where the family does, before the mask.

        Computed on first use (most consumers never need it), with the families' eager operations.
        """
        if "scores" not in self._cache:
            key = self.head_key(self.key[:, :, : self.key_width])
            scores = attention_scores(self.query, key, self.scaling, self.softcap)
            self._cache["scores"] = scores if self.bias is None else scores + self.bias
        return self._cache["scores"]

    def sink_share(self) -> Tensor:
        """(B, H, q) the weight each row gives the head's own sink logit (zeros for a family without sinks)."""
        if self.sink_weight is not None:
            return self.sink_weight
        batch, heads, rows, _ = self.weights.shape
        return torch.zeros(batch, heads, rows, dtype=torch.float32, device=self.weights.device)

    @property
    def last_chunk(self) -> bool:
        """Whether this chunk holds the layer call's last query rows (a consumer flushes a layer's sums here)."""
        return self.query_start + self.weights.shape[2] == self.query_length

    @property
    def key_length(self) -> int:
        """Every key of the layer call (``Tk``)."""
        return self.key.shape[-2]

    @property
    def key_width(self) -> int:
        """Key columns computed for this chunk: the per-row tensors cover columns ``[0, key_width)``."""
        return self.weights.shape[-1]

    @property
    def key_index_offset(self) -> int:
        """Key column of query row 0 of this chunk (past tokens from a KV cache come first).

        A column, not a position: with a sliding-window cache the columns hold only the recent keys.
        """
        return self.key_length - self.query_length + self.query_start

    def allowed(self) -> Tensor:
        """(B, 1, q, Tk) bool: which keys each query may read."""
        if "allowed" not in self._cache:
            if self.mask is None:
                batch, _, rows, keys = self.weights.shape
                allowed = torch.ones(batch, 1, rows, keys, dtype=torch.bool, device=self.weights.device)
            else:
                allowed = self.mask > torch.finfo(self.mask.dtype).min / 2
            self._cache["allowed"] = allowed
        return self._cache["allowed"]

    def visible_keys(self) -> Tensor:
        """(B, 1, q) how many keys each query may read."""
        if "visible" not in self._cache:
            self._cache["visible"] = self.allowed().sum(-1)
        return self._cache["visible"]

    def row_max(self) -> tuple[Tensor, Tensor]:
        """(B, H, q) largest weight of each row and its key column (shared by every consumer)."""
        if "row_max" not in self._cache:
            self._cache["row_max"] = self.weights.max(-1)
        return self._cache["row_max"]

    def row_peak(self) -> Tensor:
        """(B, H, q) largest weight of each row (cheaper than :meth:`row_max` when the column is not needed)."""
        if "row_max" in self._cache:
            return self._cache["row_max"][0]
        if "row_peak" not in self._cache:
            self._cache["row_peak"] = self.weights.amax(-1)
        return self._cache["row_peak"]

    def row_entropy(self) -> Tensor:
        """(B, H, q) entropy of each row in nats, from the softmax input in two passes.

        With m = max_j z_j and w_max = max_j p_j, log p_j = (z_j − m) + log w_max, so
        H = −Σ_j p_j log p_j = −log w_max − (Σ_j p_j z_j − m). Masked keys have p_j = 0 and add nothing; the
        float32 error is about 1e-6 · max|z| nats.

        With a sink column (GPT-OSS) the rows of ``weights`` sum to 1 − sink share and the direct formula over the
        real keys is used: −Σ_j p_j log p_j, the sink column's own term left out.
        """
        if "entropy" not in self._cache:
            logits = self.logits
            half = self.weights.dtype not in (torch.float32, torch.float64)
            if logits is None or half or self.sink_weight is not None:
                # the direct formula, in float32: without the softmax input, or when the weights were rounded to
                # a half-precision dtype or share their row with a sink (their rows do not sum to 1, which the
                # two-pass formula assumes)
                entropy = torch.special.entr(self.weights.float()).sum(-1)
            else:
                top = logits.amax(-1)  # (B, H, q)
                dot = torch.einsum("bhqk,bhqk->bhq", self.weights, logits) - top  # Σ p (z − m), as Σ p = 1
                entropy = -(self.row_peak().clamp_min(1e-30).log() + dot)
            self._cache["entropy"] = entropy.clamp_min(0.0)
        return self._cache["entropy"]

    def head_key(self, tensor: Tensor) -> Tensor:
        """Expand a (B, Hkv, Tk, D) key/value tensor to one slice per query head (repeat_kv layout)."""
        return repeat_kv(tensor, self.kv_groups)


class StopCapture(Exception):
    """Raised after the last wanted layer when the caller needs no model output (the rest is skipped)."""


class AttentionConsumer(Protocol):
    """Receives each captured layer (or query chunk) in order; keeps only what it needs.

    ``accepts_key_prefix``: a consumer that reads per-row tensors only up to ``LayerAttention.key_width``
    says ``True``; when all consumers of a capture do, causal chunks skip the key columns none of their rows
    may read (about half the work on long texts). Consumers that read every column say ``False``.
    """

    accepts_key_prefix: ClassVar[bool]

    def on_layer(self, layer: LayerAttention) -> None: ...


def repeat_kv(hidden: Tensor, groups: int) -> Tensor:
    """(B, Hkv, T, D) -> (B, Hkv·groups, T, D); query head h reads KV head h // groups."""
    if groups == 1:
        return hidden
    batch, kv_heads, length, head_dim = hidden.shape
    hidden = hidden[:, :, None].expand(batch, kv_heads, groups, length, head_dim)
    return hidden.reshape(batch, kv_heads * groups, length, head_dim)


@dataclass
class _CaptureState:
    modules: dict[int, tuple[str, int]]  # id(attention module) -> (stack, layer index within the stack)
    consumers: Sequence[AttentionConsumer]
    layers: frozenset[int] | None
    query_chunk: int | None
    stack: str = SELF  # the stack being captured; the other stacks' layers run uncaptured
    inputs: dict[int, tuple[Tensor, Any]] = field(default_factory=dict)
    buffer: Tensor | None = None  # flat storage for the logits of one block, reused by every block that fits
    key_prefix: bool = False  # every consumer reads per-row tensors only up to key_width
    stop_after: int | None = None  # raise StopCapture once this layer has been handed to the consumers
    last_wanted: int | None = None  # the last layer of ``stack`` handed to the consumers (None: the stack's last)
    checkpoint: Callable[[], None] | None = None  # raises to stop the pass (cancelled call, deadline)

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def may_run_sdpa(self, stack: str, layer: int) -> bool:
        """Whether an uncaptured layer may run sdpa: only a layer of the captured stack after its last captured
        layer, whose result reaches no captured map (sdpa differs from eager by ~1e-7 per layer in float32, and
        the difference compounds through every later layer: 1e-5 by layer 14 of a 16-layer model)."""
        return stack == self.stack and self.last_wanted is not None and layer > self.last_wanted


_ACTIVE: contextvars.ContextVar[_CaptureState | None] = contextvars.ContextVar("attention_capture", default=None)


def soft_capped(scores: Tensor, softcap: float | None) -> Tensor:
    """Logit soft-capping ``c · tanh(scores / c)`` where the family uses it (``softcap = c``); else the scores."""
    return torch.tanh(scores / softcap) * softcap if softcap is not None else scores


def attention_scores(query: Tensor, key: Tensor, scaling: float, softcap: float | None) -> Tensor:
    """(B, H, q, D) x (B, H, Tk, D) -> (B, H, q, Tk): the families' eager pre-mask scores (before additive terms)."""
    return soft_capped(torch.matmul(query, key.transpose(-1, -2)) * scaling, softcap)


@dataclass(frozen=True)
class _Terms:
    """What a family adds to the scores of one call: an additive bias and/or per-head sink logits."""

    bias: Tensor | None = None  # (B or 1, H, q or 1, Tk)
    names: tuple[str, ...] = ()  # what ``bias`` holds
    sinks: Tensor | None = None  # (H,)

    @property
    def empty(self) -> bool:
        return self.bias is None and self.sinks is None

    @property
    def labels(self) -> tuple[str, ...]:
        return self.names + ((SINK_LOGIT,) if self.sinks is not None else ())

    def rows(self, start: int, stop: int, keys: int) -> Tensor | None:
        """The bias for query rows [start, stop) and key columns [0, keys)."""
        if self.bias is None:
            return None
        bias = self.bias[:, :, start:stop] if self.bias.shape[2] > 1 else self.bias
        return bias[..., :keys]


def _eager_rows(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    scaling: float,
    softcap: float | None,
    dropout: float,
    training: bool,
    buffer: Tensor | None = None,
    bias: Tensor | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One block of query rows: (logits, weights, output, sink weight), the families' eager math.

    logits = q·kᵀ·scaling (soft-capped) + bias + mask. With ``sinks`` (H,) the softmax runs over the logits and
    one more column holding the head's sink logit (GPT-OSS's eager ``cat([scores, sinks])``); the weights keep
    the real columns and the sink column's weight is returned as well (else None).

    ``logits`` is written into ``buffer`` (flat storage) when it is large enough, so a long capture reuses one
    allocation instead of faulting in fresh pages for every chunk.
    """
    shape = (*query.shape[:-1], key.shape[-2])
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    out = None
    if buffer is not None and buffer.numel() >= numel and buffer.dtype == query.dtype:
        out = buffer[:numel].view(shape)
    logits = torch.matmul(query, key.transpose(-1, -2), out=out)  # (B, H, q, Tk)
    logits.mul_(scaling)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    if bias is not None:
        logits.add_(bias)
    if mask is not None:
        logits.add_(mask)
    sink_weight = None
    if sinks is None:
        weights = nn.functional.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        # GPT-OSS's own order: concatenate, subtract the row max, softmax in the logits' dtype (bit-identical in
        # half precision too, where a float32 softmax would round differently)
        column = sinks.reshape(1, -1, 1, 1).to(logits.dtype).expand(*logits.shape[:-1], 1)
        combined = torch.cat([logits, column], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = nn.functional.softmax(combined, dim=-1, dtype=combined.dtype)
        weights, sink_weight = probs[..., :-1].to(query.dtype), probs[..., -1]
    applied = nn.functional.dropout(weights, p=dropout, training=training) if dropout else weights
    output = torch.matmul(applied, value)  # (B, H, q, D)
    return logits, weights, output, sink_weight


def _key_stops(mask: Tensor, keys: int, chunk: int) -> list[int]:
    """Key columns each block of ``chunk`` query rows needs: one past the last column any of its rows may read.

    ``keys`` (no truncation) for a block with a row that may read nothing: eager softmax spreads such a row
    uniformly over every column, which a narrower block would change. Computed for every block of the layer on
    the mask's device and copied to the host once (not a synchronisation per block).
    """
    allowed = mask[..., :keys] > torch.finfo(mask.dtype).min / 2  # (B, 1, q, Tk)
    rows = allowed.shape[2]
    # last readable column of each row: Tk − 1 − (first True from the right); rows reading nothing need every key
    last = keys - allowed.flip(-1).to(torch.uint8).argmax(-1)  # (B, 1, q) one past the last readable column
    need = torch.where(allowed.any(-1), last, torch.full_like(last, keys)).amax(dim=(0, 1))  # (q,)
    padded = torch.nn.functional.pad(need, (0, (-rows) % chunk), value=0)
    return padded.view(-1, chunk).amax(-1).tolist()  # (blocks,)


def _score_terms(module: nn.Module, query: Tensor, kwargs: dict[str, Any]) -> _Terms:
    """Pop the additive terms a family passes (``position_bias``, ``s_aux``/``sinks``) and check their shapes.

    A zero bias (T5's cross-attention, which has no bias table and passes zeros) adds nothing and is dropped, so
    the layer names no term it does not have.
    """
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            msg = (
                f"{type(module).__name__} passes {name!r} to the attention function, a term capture does not "
                "reproduce: refusing rather than returning inexact attention"
            )
            raise UnsupportedModelError(msg)
    bias = kwargs.pop("position_bias", None)
    given = kwargs.pop("score_terms", None)
    names = tuple(given) if given is not None else (RELATIVE_POSITION_BIAS,)
    sinks = kwargs.pop("s_aux", None)
    other = kwargs.pop("sinks", None)
    sinks = sinks if sinks is not None else other
    heads = query.shape[1]
    if bias is not None:
        if bias.dim() != 4 or bias.shape[1] not in (1, heads):
            msg = f"{type(module).__name__} passes a position_bias of shape {tuple(bias.shape)}, not (B, H, q, Tk)"
            raise UnsupportedModelError(msg)
        if not bool(bias.any()):
            bias = None
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != heads):
        msg = (
            f"{type(module).__name__} passes sink logits of shape {tuple(sinks.shape)}; capture reproduces one "
            f"learned logit per head ({heads},) only"
        )
        raise UnsupportedModelError(msg)
    return _Terms(bias=bias, names=names if bias is not None else (), sinks=sinks)


def attention_scale(module: nn.Module, query: Tensor, scaling: float | None) -> float:
    """The ``scaling`` an attention function was given, or the families' default ``head_dim ** -0.5`` for None."""
    return scaling if scaling is not None else getattr(module, "head_dim", query.shape[-1]) ** -0.5


def sdpa_forward(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
) -> tuple[Tensor, Any]:
    """transformers' sdpa attention; GQA is expanded here for modules without ``num_key_value_groups`` (sdpa expands
    it from there, and adapted modules such as Falcon's do not carry it)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and getattr(module, "num_key_value_groups", None) != groups:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def capture_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """The registered attention function: eager math, with every wanted layer handed to the active consumers.

    Besides the interface's arguments it accepts ``position_bias=`` (an additive (B or 1, H, q or 1, Tk) term),
    ``score_terms=`` (the names of what ``position_bias`` holds; default ``("relative position bias",)``) and
    ``s_aux=``/``sinks=`` (one sink logit per head).
    """
    terms = _score_terms(module, query, kwargs)
    scaling = attention_scale(module, query, scaling)
    softcap = kwargs.get("softcap")
    state = _ACTIVE.get()
    where = state.modules.get(id(module)) if state is not None else None
    if state is not None and where is not None and state.checkpoint is not None:
        state.checkpoint()  # between layers: a cancelled or overdue call stops here, before this layer's work
    if state is None or where is None:
        # No capture in this context (e.g. another thread) or a module capture does not know: plain eager math.
        plain = _CaptureState(modules={}, consumers=(), layers=None, query_chunk=None)  # one block, no consumer
        outputs, weights = _captured_rows(
            plain, None, module, query, key, value, attention_mask, float(scaling), softcap, dropout, terms
        )
        return outputs[0].transpose(1, 2).contiguous(), weights
    stack, layer = where
    wanted = stack == state.stack and state.wants(layer)
    fast = terms.empty and softcap is None and query.dtype in SDPA_AFTER_DTYPES
    if not wanted and fast and state.may_run_sdpa(stack, layer):
        # Layers after the last captured one run fast with sdpa in float32: they reach no captured map, only the
        # output (within 2e-5 of the eager output). Every layer before it runs the eager math (chunked, uncaptured),
        # so a captured layer reads the hidden states of the model's own eager pass whatever subset is asked for.
        # sdpa cannot soft-cap or add a bias or a sink column, so such layers stay eager. In half precision the
        # output would be neither the eager pass the report explains nor the sdpa pass (SDPA_AFTER_DTYPES says
        # what was measured), so there every layer that runs runs the eager math.
        return sdpa_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    outputs, last_weights = _captured_rows(
        state, (stack, layer) if wanted else None, module, query, key, value, attention_mask, float(scaling),
        softcap, dropout, terms,
    )  # fmt: skip
    if wanted and layer == state.stop_after:
        raise StopCapture
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # (B, H, T, D)
    # Whole-map weights are returned only when one chunk covers every row (what output_attentions shows).
    return output.transpose(1, 2).contiguous(), last_weights if len(outputs) == 1 else None


def _additive_mask(attention_mask: Tensor | None, dtype: torch.dtype, keys: int) -> Tensor | None:
    """The mask as the eager functions use it: additive (0 or dtype-min), cut to the keys of the call."""
    mask = float_mask(attention_mask, dtype)
    return None if mask is None else mask[..., :keys]


def _captured_rows(
    state: _CaptureState,
    where: tuple[str, int] | None,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    softcap: float | None,
    dropout: float,
    terms: _Terms,
) -> tuple[list[Tensor], Tensor]:
    """Eager attention of one layer call, block by block of query rows, each block handed to the consumers.

    ``where``: the (stack, layer) to hand to the consumers, or None for a layer that only runs (eager, chunked).
    Returns the blocks' outputs (B, H, q, D) and the last block's weights.
    """
    groups = query.shape[1] // key.shape[1]
    key_states, value_states = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, Tk, D)
    attention_mask = _additive_mask(attention_mask, query.dtype, key_states.shape[-2])
    length = query.shape[2]
    chunk = state.query_chunk or length
    recorded = state.inputs.pop(where[1], None) if where is not None else None
    outputs = []
    weights = query.new_empty(0)
    per_row_mask = attention_mask is not None and attention_mask.shape[2] > 1
    stops: list[int] | None = None
    if state.key_prefix and length > chunk and attention_mask is not None and per_row_mask:
        stops = _key_stops(attention_mask, key_states.shape[-2], chunk)  # one host copy per layer
    for index, start in enumerate(range(0, length, chunk)):
        if start and state.checkpoint is not None:
            state.checkpoint()  # between query chunks: one layer of a long text can take seconds
        stop = min(start + chunk, length)
        rows = query[:, :, start:stop]
        mask = attention_mask[:, :, start:stop] if attention_mask is not None and per_row_mask else attention_mask
        keys = stops[index] if stops is not None else key_states.shape[-2]
        mask = mask[..., :keys] if mask is not None else None
        bias = terms.rows(start, stop, keys)
        logits, weights, output, sink_weight = _eager_rows(
            rows, key_states[:, :, :keys], value_states[:, :, :keys], mask, scaling, softcap, dropout,
            module.training, state.buffer, bias, terms.sinks,
        )  # fmt: skip
        if state.buffer is None or state.buffer.numel() < logits.numel():
            state.buffer = logits.view(-1)  # the next blocks that fit write their logits here
        outputs.append(output)
        if where is None:
            continue
        if mask is not None and mask.shape[2] != stop - start:
            mask = mask.expand(mask.shape[0], mask.shape[1], stop - start, mask.shape[3])
        if bias is not None and bias.shape[2] != stop - start:
            bias = bias.expand(bias.shape[0], bias.shape[1], stop - start, bias.shape[3])
        captured = LayerAttention(
            layer=where[1], query=rows, key=key, value=value, mask=mask, logits=logits, output=output,
            weights=weights, scaling=scaling, softcap=float(softcap) if softcap is not None else None,
            kv_groups=groups, query_start=start, query_length=length, module=module,
            layer_input=recorded[0] if recorded else None, position_embeddings=recorded[1] if recorded else None,
            stack=where[0], terms=terms.labels, bias=bias, sink_logits=terms.sinks, sink_weight=sink_weight,
        )  # fmt: skip
        for consumer in state.consumers:
            consumer.on_layer(captured)
        captured.logits = None  # the buffer is about to be overwritten
    return outputs, weights


AttentionInterface.register(CAPTURE_IMPLEMENTATION, capture_attention_forward)
AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, eager_mask)


def _configs(model: nn.Module) -> list[Any]:
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            seen.setdefault(id(config), config)
            for key in getattr(config, "sub_configs", {}) or {}:
                sub = getattr(config, key, None)
                if sub is not None and hasattr(sub, "_attn_implementation_internal"):
                    seen.setdefault(id(sub), sub)
    return list(seen.values())


@contextmanager
def attention_implementation(
    model: nn.Module, implementation: str, *, active: tuple[contextvars.ContextVar[Any], Any] | None = None
) -> Iterator[None]:
    """Switch a model's attention implementation for the block; restore every config in ``finally``.

    ``active``: (the registered function's context variable, its state for the block), set and reset with it."""
    configs = _configs(model)
    previous = [config._attn_implementation_internal for config in configs]
    token = active[0].set(active[1]) if active is not None else None
    try:
        for config in configs:
            config._attn_implementation_internal = implementation
        yield
    finally:
        for config, value in zip(configs, previous, strict=True):
            config._attn_implementation_internal = value
        if active is not None and token is not None:
            active[0].reset(token)


@contextmanager
def capture_attention(
    model: nn.Module,
    consumers: Sequence[AttentionConsumer],
    *,
    stack: str | None = None,
    layers: Sequence[int] | None = None,
    query_chunk: int | None = None,
    record_inputs: bool = False,
    stop_after_last: bool = False,
    checkpoint: Callable[[], None] | None = None,
) -> Iterator[_CaptureState]:
    """Run forwards inside this block and every wanted layer streams to ``consumers``.

    Args:
        model: a transformers model whose family routes attention through the attention interface.
        consumers: objects with ``on_layer(LayerAttention)``; called in layer order, per query chunk.
        stack: the attention stack to capture (``"self"``; ``"encoder"``, ``"decoder"`` or ``"cross"`` of an
            encoder–decoder); ``None`` is the model's default (``"self"``, or ``"encoder"``). The other stacks'
            layers run uncaptured with the model's own math.
        layers: capture only these layers of the stack; ``None`` captures all. Every layer up to the last
            captured one runs the eager math (so any subset gives the maps of the model's eager pass); layers
            after it run sdpa in float32 where the family adds no term (they change only the output, ~1e-6).
        query_chunk: compute at most this many query rows at a time (bounds memory to H·chunk·T).
        record_inputs: also hand each consumer the hidden states entering the attention module and the
            rotary (cos, sin), via a forward pre-hook removed in ``finally``.
        stop_after_last: raise :class:`StopCapture` right after the last wanted layer, for callers that need
            only what the consumers collect (the caller catches it).
        checkpoint: called before every layer's attention and between query chunks; it raises (e.g.
            :class:`~agent_tools.errors.CallCancelledError`) to stop the pass. The exception unwinds through this
            block's ``finally`` (configs and hooks restored) and the caller's lock, so a stopped call leaves the
            model as it found it.
    """
    stacks = attention_stacks(model)
    name = default_stack_name(stacks) if stack is None else stack
    if name not in stacks:
        valid = ", ".join(repr(s) for s in stacks)
        raise InvalidInputError(f"the model has no {name!r} attention stack; valid: {valid}", field="attention")
    modules = stacks[name]
    state = _CaptureState(
        modules={id(m): (s, i) for s, members in stacks.items() for i, m in enumerate(members)},
        consumers=list(consumers),
        layers=frozenset(layers) if layers is not None else None,
        query_chunk=query_chunk,
        stack=name,
        key_prefix=bool(consumers) and all(c.accepts_key_prefix for c in consumers),
        checkpoint=checkpoint,
    )
    state.last_wanted = max(state.layers, default=-1) if state.layers is not None else len(modules) - 1
    if stop_after_last:
        state.stop_after = state.last_wanted if state.layers else len(modules) - 1
    recorders = (
        module.register_forward_pre_hook(_input_recorder(state, index), with_kwargs=True)
        for index, module in enumerate(modules)
        if record_inputs and state.wants(index)
    )
    with hooks_registered(recorders), ExitStack() as routes:
        # A family outside the interface: every one of its modules (wanted or not) runs its adapter's forward, which
        # calls ours; its own forward under our implementation name could take a different path (Falcon's eager
        # branch adds ALiBi twice), so no layer is left to it.
        for members in stacks.values():
            for module in members:
                adapter = adapter_for(module)
                if adapter is not None:
                    routes.enter_context(adapter.routed(module, capture_attention_forward))
        with attention_implementation(model, CAPTURE_IMPLEMENTATION, active=(_ACTIVE, state)):
            yield state


@contextmanager
def hooks_registered(registrations: Iterable[RemovableHandle]) -> Iterator[None]:
    """Inside the block the hooks ``registrations`` registers are in place; every one is removed in ``finally``.

    Give a generator (``(m.register_forward_hook(h) for m in modules)``): it registers inside the ``try``, so when
    registering a later hook fails the earlier ones are removed too.
    """
    with ExitStack() as handles:
        for handle in registrations:
            handles.callback(handle.remove)
        yield


@contextmanager
def layer_checkpoints(model: nn.Module, checkpoint: Callable[[], None] | None) -> Iterator[None]:
    """Call ``checkpoint`` before every attention module's forward and before the output head's, for passes that
    run without capture.

    Ablated passes use the model's own attention implementation, so :func:`capture_attention` never sees their
    layers; a forward pre-hook on each attention module gives them the same between-layer stop. The output head
    (a batch of rows × a long text × the vocabulary: seconds on a CPU) gets one too, so a call cancelled during the
    last layer stops before it. The hooks are removed in ``finally``; with ``checkpoint=None`` nothing is registered.
    """
    if checkpoint is None:
        yield
        return
    check = checkpoint

    def hook(module: nn.Module, args: tuple) -> None:
        check()

    modules = [module for members in attention_stacks(model).values() for module in members]
    head = output_head(model)
    modules += [head] if head is not None else []
    with hooks_registered(module.register_forward_pre_hook(hook) for module in modules):
        yield


def called_hidden_states(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """The hidden states an attention module was called with (its first argument, or ``hidden_states=``)."""
    hidden = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("hidden_states")
    return hidden if isinstance(hidden, Tensor) else None


def _input_recorder(state: _CaptureState, layer: int) -> Callable[[nn.Module, tuple, dict], None]:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = called_hidden_states(args, kwargs)
        if hidden is not None:
            rotary = kwargs.get("position_embeddings")
            adapter = adapter_for(module)
            if adapter is not None and not adapter.uses_rotary(module):
                rotary = None  # Falcon hands (cos, sin) to its ALiBi layers too, which ignore them
            state.inputs[layer] = (hidden, rotary)

    return hook
