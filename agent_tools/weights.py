"""Per-family access to one attention head's projection weights: W_Q, W_K, W_V, W_O slices and biases.

Every family stores the same four maps differently (separate ``q_proj``/``k_proj``, BERT's ``query``/``key``,
GPT-2's fused ``c_attn`` Conv1D laid out ``(in, out)``, GPT-NeoX's fused ``query_key_value`` interleaved per
head, Phi-3's fused ``qkv_proj``). :func:`head_projections` reads one head's slices into one convention
(TransformerLens'): ``q = x @ w_q + b_q`` with ``w_q`` of shape ``(d_model, d_head)`` and the head's
contribution to the residual stream ``z @ w_o`` with ``w_o`` of shape ``(d_head, d_model)``.

Families not listed in :data:`PROJECTION_FAMILIES` are refused with :class:`UnsupportedModelError`: a wrong
slice gives plausible-looking but wrong numbers, so we never guess a layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from agent_tools.errors import UnsupportedModelError
from agent_tools.families import find_attention_modules

ProjectionLayout = Literal["separate", "bert", "gpt2_conv1d", "neox_fused", "phi3_fused"]
PROJECTION_LAYOUTS: tuple[str, ...] = get_args(ProjectionLayout)

# model_type -> how its attention stores W_Q, W_K, W_V, W_O. Each is covered by a tiny-model parity test.
PROJECTION_FAMILIES: dict[str, ProjectionLayout] = {
    "llama": "separate",
    "mistral": "separate",
    "qwen2": "separate",
    "gemma2": "separate",
    "opt": "separate",
    "bert": "bert",
    "gpt2": "gpt2_conv1d",
    "gpt_neox": "neox_fused",
    "phi3": "phi3_fused",
}
SUPPORTED_PROJECTION_FAMILIES: tuple[str, ...] = tuple(PROJECTION_FAMILIES)


@dataclass(frozen=True)
class HeadProjections:
    """One query head's projection slices (and those of the KV head it reads), detached float tensors.

    ``q = x @ w_q + b_q`` (then RoPE where the family uses it); ``k``, ``v`` likewise for the KV head;
    the head's output ``z`` (d_head,) writes ``z @ w_o`` into the residual stream (before ``b_o``, shared by
    all heads). ``query_prescale`` is the factor some families (OPT) fold into the query projection instead
    of passing it to the attention function; 1.0 elsewhere.
    """

    family: str
    layout: ProjectionLayout
    layer: int
    head: int
    kv_head: int
    w_q: Tensor  # (d_model, d_head)
    b_q: Tensor | None  # (d_head,)
    w_k: Tensor  # (d_model, d_head)
    b_k: Tensor | None
    w_v: Tensor  # (d_model, d_head)
    b_v: Tensor | None
    w_o: Tensor  # (d_head, d_model)
    query_prescale: float = 1.0

    @property
    def d_model(self) -> int:
        return self.w_q.shape[0]

    @property
    def d_head(self) -> int:
        return self.w_q.shape[1]

    def queries(self, x: Tensor) -> Tensor:
        """(..., T, d_model) -> (..., T, d_head) before positions, without ``query_prescale``."""
        return _affine(x, self.w_q, self.b_q)

    def keys(self, x: Tensor) -> Tensor:
        return _affine(x, self.w_k, self.b_k)

    def values(self, x: Tensor) -> Tensor:
        return _affine(x, self.w_v, self.b_v)


def _affine(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    out = x.to(weight.dtype) @ weight
    return out + bias if bias is not None else out


def _rows(linear: nn.Module, start: int, size: int) -> tuple[Tensor, Tensor | None]:
    """nn.Linear stores (out, in): output features start..start+size as (in, size) plus their bias."""
    weight = linear.weight.detach()[start : start + size].T.float()  # (d_model, size)
    bias = getattr(linear, "bias", None)
    return weight, bias.detach()[start : start + size].float() if bias is not None else None


def _conv1d_columns(conv: nn.Module, start: int, size: int) -> tuple[Tensor, Tensor | None]:
    """GPT-2's Conv1D stores (in, out): output features start..start+size as (in, size) plus their bias."""
    weight = conv.weight.detach()[:, start : start + size].float()  # (d_model, size)
    bias = getattr(conv, "bias", None)
    return weight, bias.detach()[start : start + size].float() if bias is not None else None


def _parent_output_dense(model: nn.Module, attention: nn.Module) -> nn.Module:
    """BERT keeps W_O outside the self-attention module: ``<parent>.output.dense``."""
    names = {id(m): n for n, m in model.named_modules()}
    name = names.get(id(attention), "")
    parent_name = name.rsplit(".", 1)[0] if "." in name else ""
    parent = model.get_submodule(parent_name) if parent_name else model
    output = getattr(parent, "output", None)
    dense = getattr(output, "dense", None)
    if dense is None:
        msg = f"could not find the output projection (W_O) of layer {getattr(attention, 'layer_idx', '?')}"
        raise UnsupportedModelError(msg)
    return dense


def projection_family(model: nn.Module) -> ProjectionLayout:
    """The weight layout of a supported family, or UnsupportedModelError naming the supported ones."""
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    layout = PROJECTION_FAMILIES.get(family)
    if layout is None:
        msg = (
            f"reading per-head W_Q/W_K/W_V/W_O is not supported for family {family!r}; "
            f"supported families: {', '.join(SUPPORTED_PROJECTION_FAMILIES)}"
        )
        raise UnsupportedModelError(msg, field="model")
    return layout


def head_projections(model: nn.Module, layer: int, head: int) -> HeadProjections:
    """One head's W_Q, W_K, W_V, W_O slices and biases, in the ``x @ W`` convention.

    Args:
        model: a loaded transformers model of a family in :data:`PROJECTION_FAMILIES`.
        layer: attention layer index (already validated by the caller).
        head: query head index (already validated); its KV head is ``head // (num_heads // num_kv_heads)``.
    """
    layout = projection_family(model)
    attention = find_attention_modules(model)[layer]
    config = model.config
    family = config.model_type
    num_heads = int(getattr(config, "num_attention_heads", None) or config.n_head)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    d_model = int(getattr(config, "hidden_size", None) or config.n_embd)
    d_head = int(
        getattr(attention, "head_dim", None)
        or getattr(attention, "head_size", None)
        or getattr(attention, "attention_head_size", None)
        or d_model // num_heads
    )
    kv_head = head // (num_heads // num_kv_heads)
    prescale = 1.0
    if layout == "separate":
        w_q, b_q = _rows(attention.q_proj, head * d_head, d_head)
        w_k, b_k = _rows(attention.k_proj, kv_head * d_head, d_head)
        w_v, b_v = _rows(attention.v_proj, kv_head * d_head, d_head)
        out = attention.o_proj if hasattr(attention, "o_proj") else attention.out_proj
        w_o = out.weight.detach()[:, head * d_head : (head + 1) * d_head].T.float()  # (d_head, d_model)
        if family == "opt":
            prescale = float(attention.scaling)
    elif layout == "bert":
        w_q, b_q = _rows(attention.query, head * d_head, d_head)
        w_k, b_k = _rows(attention.key, kv_head * d_head, d_head)
        w_v, b_v = _rows(attention.value, kv_head * d_head, d_head)
        dense = _parent_output_dense(model, attention)
        w_o = dense.weight.detach()[:, head * d_head : (head + 1) * d_head].T.float()
    elif layout == "gpt2_conv1d":
        split = attention.split_size  # = d_model: [queries | keys | values] along the output axis
        w_q, b_q = _conv1d_columns(attention.c_attn, head * d_head, d_head)
        w_k, b_k = _conv1d_columns(attention.c_attn, split + kv_head * d_head, d_head)
        w_v, b_v = _conv1d_columns(attention.c_attn, 2 * split + kv_head * d_head, d_head)
        w_o = attention.c_proj.weight.detach()[head * d_head : (head + 1) * d_head].float()  # (d_head, d_model)
    elif layout == "neox_fused":
        # view(B, T, H, 3·d_head) then chunk(3): head h owns rows h·3·d_head + [q | k | v].
        base = head * 3 * d_head
        w_q, b_q = _rows(attention.query_key_value, base, d_head)
        w_k, b_k = _rows(attention.query_key_value, base + d_head, d_head)
        w_v, b_v = _rows(attention.query_key_value, base + 2 * d_head, d_head)
        w_o = attention.dense.weight.detach()[:, head * d_head : (head + 1) * d_head].T.float()
    else:  # phi3_fused: [all query heads | all key heads | all value heads]
        q_size, kv_size = num_heads * d_head, num_kv_heads * d_head
        w_q, b_q = _rows(attention.qkv_proj, head * d_head, d_head)
        w_k, b_k = _rows(attention.qkv_proj, q_size + kv_head * d_head, d_head)
        w_v, b_v = _rows(attention.qkv_proj, q_size + kv_size + kv_head * d_head, d_head)
        w_o = attention.o_proj.weight.detach()[:, head * d_head : (head + 1) * d_head].T.float()
    return HeadProjections(
        family=family,
        layout=layout,
        layer=layer,
        head=head,
        kv_head=kv_head,
        w_q=w_q.clone(),
        b_q=b_q.clone() if b_q is not None else None,
        w_k=w_k.clone(),
        b_k=b_k.clone() if b_k is not None else None,
        w_v=w_v.clone(),
        b_v=b_v.clone() if b_v is not None else None,
        w_o=w_o.clone(),
        query_prescale=prescale,
    )


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one tensor: (..., T, d_head) with cos/sin (..., T, d_rot).

    The first ``d_rot = cos.shape[-1]`` dims are rotated in the "rotate_half" layout (Llama, Mistral, Qwen2,
    Gemma2 with ``d_rot = d_head``; GPT-NeoX and Phi with partial rotary ``d_rot < d_head``); the rest pass.
    """
    rotary = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotated_half = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated_half * sin, x_pass), dim=-1)
