"""Families whose attention never calls transformers' attention interface, routed through it exactly.

BLOOM, MPT and Falcon compute attention inline in their modules (ALiBi, or rotary for Falcon); DeBERTa-v2/v3 adds
its disentangled content→position and position→content terms inline. A :class:`FamilyAdapter` knows one such
module: :meth:`FamilyAdapter.routed` swaps in a forward that does the family's own work up to the attention core
(projections, fused q/k/v split, rotary, cache update, the family's additive score term), hands q, k, v, the
additive mask, the scaling and that term to an attention function with the interface's signature::

    attention_fn(module, query, key, value, mask, scaling=..., dropout=..., position_bias=term,
                 score_terms=("ALiBi",)) -> (output (B, q, H, D), weights (B, H, q, Tk) | None)

and finishes as the family does (output projection, residual where the module adds it, the return tuple its block
expects). The original forward is restored in ``finally``. Model I/O layer: nothing here imports capture.

What "exact" means per family (transformers 5.24, float32). In half precision results differ by rounding only:
rotary Falcon and DeBERTa take their softmax in the input dtype where the attention function takes it in float32,
and BLOOM's fused ``baddbmm`` rounds once where ``q·kᵀ·scale + bias`` rounds per step.

- **BLOOM**: ``alibi.baddbmm(q, kᵀ, beta=1, alpha=1/√D) + mask``; the term is the model's own ``alibi`` tensor.
- **MPT**: ``q·kᵀ·softmax_scale + alibi[..., -Tk:]`` then ``masked_fill(mask, min)``; ``clip_qkv`` is applied to
  the fused projection as the module does.
- **Falcon**: rotary (eager and sdpa agree) or ALiBi. With ALiBi the model merges ``alibi/√D`` into the mask it
  passes its layers; its default sdpa path adds that once, which is ALiBi as defined. Its eager path (taken
  whenever ``output_attentions=True`` or the implementation is not sdpa) adds the module's ``alibi·(1/√D)`` on top:
  ALiBi twice. The routed forward reproduces the default path (once), so capture matches what the model computes
  when it generates.
- **DeBERTa-v2/v3**: ``q·kᵀ/√(D·f) + c2p + p2c`` with ``f = 1 + |pos_att_type ∩ {c2p, p2c}|``; the term is the
  module's own ``disentangled_attention_bias`` (relative embeddings, log buckets, ``share_att_key``).
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from agent_tools.errors import InvalidInputError, UnsupportedModelError

# (module, query, key, value, mask, *, scaling, dropout, position_bias, score_terms) -> (output, weights)
AttentionFunction = Callable[..., tuple[Tensor, Tensor | None]]

ALIBI = "ALiBi"
DISENTANGLED = "c2p/p2c"


def _additive(mask: Tensor, dtype: torch.dtype, *, allowed_when: bool = True) -> Tensor:
    """A boolean mask as an additive one: 0 where a key may be read, dtype-min where not."""
    blocked = ~mask if allowed_when else mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(blocked, torch.finfo(dtype).min)


def float_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The mask an eager-style family adds to its scores (bool masks mean True = may read)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return _additive(mask, dtype)


class FamilyAdapter:
    """One attention module type outside the interface: its layer, scale and score terms, and its routed forward
    (its heads and widths are read like any module's, in :mod:`agent_tools.families`).

    Subclasses say which class they match (``class_name`` defined in a module whose path ends with
    ``module_suffix``: a copy of the class in another family is not matched) and implement :meth:`_forward`.
    """

    family: ClassVar[str]
    class_name: ClassVar[str]
    module_suffix: ClassVar[str]

    def matches(self, module: nn.Module) -> bool:
        return any(
            cls.__name__ == self.class_name and cls.__module__.endswith(self.module_suffix)
            for cls in type(module).__mro__
        )

    def layer_index(self, module: nn.Module, name: str = "") -> int:
        """The module's layer: its ``layer_idx`` (BLOOM, MPT, Falcon); DeBERTa reads it from its name."""
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            msg = f"{type(module).__name__} has no layer_idx; cannot tell which layer it is"
            raise UnsupportedModelError(msg)
        return layer

    def scaling(self, module: nn.Module) -> float:
        raise NotImplementedError

    def score_terms(self, module: nn.Module) -> tuple[str, ...]:
        """Names of the additive terms this module adds to q·kᵀ·scaling (what ``position_bias`` will hold)."""
        return (ALIBI,)

    def uses_rotary(self, module: nn.Module) -> bool:
        """Whether the module rotates q and k with the ``position_embeddings`` it is passed (Falcon without ALiBi).

        Falcon passes (cos, sin) to every layer, also when it uses ALiBi and ignores them.
        """
        return False

    def check(self, module: nn.Module) -> None:
        """Raise UnsupportedModelError (with the reason) for a variant the routed forward cannot reproduce."""

    @contextmanager
    def routed(self, module: nn.Module, attention_fn: AttentionFunction) -> Iterator[None]:
        """Inside the block, ``module`` computes its attention through ``attention_fn`` (same result, same returns).

        With accelerate's hooks (device maps, offload) the hook's wrapped ``_old_forward`` is replaced, so the
        hook still moves weights and inputs before the routed forward runs.
        """
        self.check(module)
        target = "_old_forward" if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__ else "forward"
        had_own = target in module.__dict__
        previous = module.__dict__.get(target)
        adapter = self

        def forward(self_module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return adapter._forward(self_module, attention_fn, *args, **kwargs)

        setattr(module, target, types.MethodType(forward, module))
        try:
            yield
        finally:
            if had_own:
                setattr(module, target, previous)
            else:
                delattr(module, target)

    def _forward(self, module: nn.Module, attention_fn: AttentionFunction, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


# --- BLOOM ------------------------------------------------------------------------------------------------
class BloomAdapter(FamilyAdapter):
    family = "bloom"
    class_name = "BloomAttention"
    module_suffix = "modeling_bloom"

    def scaling(self, module: Any) -> float:
        return float(module.inv_norm_factor)

    def check(self, module: Any) -> None:
        if float(module.beta) != 1.0:
            msg = f"BloomAttention with beta={module.beta} scales its ALiBi term; capture assumes beta = 1"
            raise UnsupportedModelError(msg)

    def _forward(
        self,
        module: Any,
        attention_fn: AttentionFunction,
        hidden_states: Tensor,
        residual: Tensor,
        alibi: Tensor,
        attention_mask: Tensor | None,
        layer_past: Any = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        batch, length, _ = hidden_states.shape
        fused = module.query_key_value(hidden_states)  # (B, T, 3·C), interleaved per head
        query, key, value = module._reshape(fused)  # 3 × (B, H, T, D)
        if layer_past is not None:
            key, value = layer_past.update(key, value, module.layer_idx)
        keys = key.shape[-2]
        bias = alibi.view(batch, module.num_heads, -1, alibi.shape[-1])  # (B, H, 1, Tk): slope·position
        bias = bias.expand(batch, module.num_heads, length, keys)  # (B, H, q, Tk)
        output, weights = attention_fn(
            module, query, key, value, float_mask(attention_mask, query.dtype),
            scaling=self.scaling(module), dropout=module.attention_dropout.p if module.training else 0.0,
            position_bias=bias, score_terms=(ALIBI,),
        )  # fmt: skip
        context = output.reshape(batch, length, module.num_heads * module.head_dim)  # (B, q, H·D)
        if module.pretraining_tp > 1 and module.slow_but_exact:
            slices = module.hidden_size / module.pretraining_tp
            projected = torch.zeros_like(context)
            for i in range(module.pretraining_tp):
                start, stop = int(i * slices), int((i + 1) * slices)
                weight = module.dense.weight[:, start:stop]
                projected = projected + nn.functional.linear(context[:, :, start:stop], weight)
        else:
            projected = module.dense(context)
        projected = residual + nn.functional.dropout(projected, p=module.hidden_dropout, training=module.training)
        return projected, weights


# --- MPT --------------------------------------------------------------------------------------------------
class MptAdapter(FamilyAdapter):
    family = "mpt"
    class_name = "MptAttention"
    module_suffix = "modeling_mpt"

    def scaling(self, module: Any) -> float:
        return float(module.softmax_scale)

    def _forward(
        self,
        module: Any,
        attention_fn: AttentionFunction,
        hidden_states: Tensor,
        position_bias: Tensor | None,
        cache: Any = None,
        attention_mask: Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        batch, length = hidden_states.shape[:2]
        mixed = module.Wqkv(hidden_states)  # (B, T, 3·C) = [Q | K | V]
        if module.clip_qkv:
            mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
        query, key, value = (
            part.reshape(batch, length, module.n_heads, module.head_dim).transpose(1, 2)
            for part in mixed.chunk(3, dim=2)
        )  # 3 × (B, H, T, D)
        if cache is not None:
            key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
        keys = key.shape[-2]
        bias = None
        if position_bias is not None:
            if position_bias.dim() != 3:
                raise ValueError(f"Expecting position_bias shape to be 3 dimensions, got {position_bias.dim()}")
            query_length = length if cache is None else length + cache.get_seq_length()
            row = max(0, position_bias.size(1) - query_length)
            column = max(0, position_bias.size(2) - keys)
            if position_bias.size(2) < keys:
                msg = (
                    f"this MPT model builds ALiBi for max_seq_len = {position_bias.size(2)} positions; the call has "
                    f"{keys} keys: give at most {position_bias.size(2)} tokens"
                )
                raise InvalidInputError(msg, field="text")
            bias = position_bias[:, row:, column:]  # (H, 1, Tk): slope·(j − Tk + 1)
            bias = bias[None].expand(batch, module.n_heads, length, keys)  # (B, H, q, Tk)
        mask = None
        if attention_mask is not None:
            mask = _additive(attention_mask.bool(), query.dtype, allowed_when=False)  # MPT's mask: True = blocked
        output, weights = attention_fn(
            module, query, key, value, mask, scaling=self.scaling(module),
            dropout=module.attn_dropout_p if module.training else 0.0,
            position_bias=bias, score_terms=(ALIBI,) if bias is not None else (),
        )  # fmt: skip
        context = output.reshape(batch, length, -1)  # (B, q, H·D)
        return module.out_proj(context), weights


# --- Falcon -----------------------------------------------------------------------------------------------
class FalconAdapter(FamilyAdapter):
    family = "falcon"
    class_name = "FalconAttention"
    module_suffix = "modeling_falcon"

    def scaling(self, module: Any) -> float:
        return float(module.inv_norm_factor)

    def score_terms(self, module: Any) -> tuple[str, ...]:
        # the one flag the module keeps only on its config (the model passes alibi=None to rotary layers)
        return (ALIBI,) if module.config.alibi else ()

    def uses_rotary(self, module: Any) -> bool:
        return not module.config.alibi

    def _forward(
        self,
        module: Any,
        attention_fn: AttentionFunction,
        hidden_states: Tensor,
        alibi: Tensor | None,
        attention_mask: Tensor | None,
        position_ids: Tensor | None = None,
        layer_past: Any = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        fused = module.query_key_value(hidden_states)  # (B, T, (H + 2·Hkv)·D)
        kv_heads = module.num_heads if module.new_decoder_architecture else module.num_kv_heads
        query, key, value = module._split_heads(fused)  # (B, T, heads, D)
        batch, length = query.shape[:2]
        heads, dim = module.num_heads, module.head_dim
        query = query.transpose(1, 2).reshape(batch, heads, length, dim)  # (B, H, T, D)
        key = key.transpose(1, 2).reshape(batch, kv_heads, length, dim)
        value = value.transpose(1, 2).reshape(batch, kv_heads, length, dim)
        if alibi is None:
            if position_embeddings is None:
                raise UnsupportedModelError("rotary Falcon layer called without position embeddings")
            cos, sin = position_embeddings
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            query, key = query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin
        if layer_past is not None:
            key, value = layer_past.update(key, value, module.layer_idx)
        if module.new_decoder_architecture:
            # _split_heads broadcast each K/V head over its query group; keep one copy per group (repeat_kv layout)
            groups = heads // module.num_kv_heads  # the config's num_kv_heads
            key, value = key[:, ::groups], value[:, ::groups]  # (B, Hkv, Tk, D)
        keys = key.shape[-2]
        bias: Tensor | None = None
        mask = float_mask(attention_mask, query.dtype)
        if alibi is not None:
            if mask is None or mask.dim() != 4:
                msg = "Falcon ALiBi layer without a materialised 4-D mask (flash attention?): cannot be captured"
                raise UnsupportedModelError(msg)
            # the model merged alibi/√D into the mask it passes: split it back into the term and a 0/min mask
            blocked = mask <= torch.finfo(mask.dtype).min / 2  # (B, H, q, Tk), the same for every head
            bias = mask.masked_fill(blocked, 0.0).expand(batch, heads, length, keys)  # (B, H, q, Tk)
            mask = _additive(blocked[:, :1], query.dtype, allowed_when=False)  # (B, 1, q, Tk)
        dropout = module.attention_dropout.p if module.training and alibi is not None else 0.0
        output, weights = attention_fn(
            module, query, key, value, mask, scaling=self.scaling(module), dropout=dropout,
            position_bias=bias, score_terms=(ALIBI,) if bias is not None else (),
        )  # fmt: skip
        context = output.reshape(batch, length, heads * dim)  # (B, q, H·D)
        return module.dense(context), weights


def rotate_half(x: Tensor) -> Tensor:
    """(..., d) -> (..., d): the two halves of the last dimension swapped, the second negated (transformers'
    ``rotate_half``, the pairing of rotary position embeddings)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# --- DeBERTa-v2 / v3 --------------------------------------------------------------------------------------
_LAYER_IN_NAME = re.compile(r"(?:^|\.)layer\.(\d+)\.")


class DebertaV2Adapter(FamilyAdapter):
    family = "deberta-v2"
    class_name = "DisentangledSelfAttention"
    module_suffix = "modeling_deberta_v2"

    def layer_index(self, module: Any, name: str = "") -> int:
        found = _LAYER_IN_NAME.findall(name)
        if not found:
            msg = f"cannot read the layer of DeBERTa-v2 attention {name!r}: expected a name with '.layer.<i>.'"
            raise UnsupportedModelError(msg)
        return int(found[-1])

    def _scale_factor(self, module: Any) -> int:
        return 1 + ("c2p" in module.pos_att_type) + ("p2c" in module.pos_att_type)

    def scaling(self, module: Any) -> float:
        # the module divides by √(D·f) computed in float32
        scale = torch.sqrt(torch.tensor(module.attention_head_size, dtype=torch.float) * self._scale_factor(module))
        return 1.0 / float(scale)

    def score_terms(self, module: Any) -> tuple[str, ...]:
        has_terms = module.relative_attention and ("c2p" in module.pos_att_type or "p2c" in module.pos_att_type)
        return (DISENTANGLED,) if has_terms else ()

    def _forward(
        self,
        module: Any,
        attention_fn: AttentionFunction,
        hidden_states: Tensor,
        attention_mask: Tensor,
        output_attentions: bool = False,
        query_states: Tensor | None = None,
        relative_pos: Tensor | None = None,
        rel_embeddings: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        if query_states is None:
            query_states = hidden_states
        heads = module.num_attention_heads
        query = module.transpose_for_scores(module.query_proj(query_states), heads)  # (B·H, q, D)
        key = module.transpose_for_scores(module.key_proj(hidden_states), heads)  # (B·H, Tk, D)
        value = module.transpose_for_scores(module.value_proj(hidden_states), heads)
        factor = self._scale_factor(module)
        term: Tensor | None = None
        if module.relative_attention:
            rel_embeddings = module.pos_dropout(rel_embeddings)
            bias = module.disentangled_attention_bias(query, key, relative_pos, rel_embeddings, factor)
            term = bias if isinstance(bias, Tensor) else None  # the int 0 when pos_att_type has neither term
        rows, keys, dim = query.shape[-2], key.shape[-2], query.shape[-1]
        query = query.view(-1, heads, rows, dim)  # (B, H, q, D)
        key, value = key.view(-1, heads, keys, dim), value.view(-1, heads, keys, dim)
        if term is not None:
            term = term.view(-1, heads, rows, keys)  # (B, H, q, Tk): c2p + p2c, already divided by √(D·f)
        mask = _additive(attention_mask.bool(), query.dtype)  # (B, 1, q, Tk): m_i·m_j, True = may read
        output, weights = attention_fn(
            module, query, key, value, mask, scaling=self.scaling(module),
            dropout=module.dropout.p if module.training else 0.0,
            position_bias=term, score_terms=(DISENTANGLED,) if term is not None else (),
        )  # fmt: skip
        context = output.reshape(output.shape[0], rows, heads * dim)  # (B, q, H·D)
        return context, weights if output_attentions else None


ADAPTERS: tuple[FamilyAdapter, ...] = (BloomAdapter(), MptAdapter(), FalconAdapter(), DebertaV2Adapter())


def adapter_for(module: nn.Module) -> FamilyAdapter | None:
    """The adapter for an attention module of a family outside the attention interface, else None."""
    for adapter in ADAPTERS:
        if adapter.matches(module):
            return adapter
    return None
