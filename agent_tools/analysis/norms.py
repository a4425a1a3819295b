"""Value-side norms (Kobayashi et al. 2020, "Attention is not only a weight"): what each key actually writes.

A head's output at query i is ``Σ_j α_ij · v_j W_O^h`` where ``v_j = x_j W_V^h (+ b_V)`` is the key's value
vector and ``W_O^h`` is the head's slice of the output projection (the ``D`` input columns of ``o_proj`` that
belong to head ``h``). A key that receives almost all the weight but whose transformed value
``u_j = v_j W_O^h`` is tiny contributes almost nothing: the head is a no-op on that row, a harmless sink.

We never build ``u_j`` (B·H·T·C numbers): ``‖v W_O^hᵀ‖² = v G_h vᵀ`` with the head's Gram matrix
``G_h = W_O^hᵀ W_O^h`` (D × D), so every norm costs O(D²) per key. The captured value tensor is used as ``v``:
it *is* ``x_j W_V (+ b_V)`` after whatever the family does (fused qkv, value norms), taken from the forward itself.

The output projection itself is found by :func:`agent_tools.layout.output_weight` (the one adapter per weight
layout); everything here is a pure function of tensors.

Shapes: ``B`` batch, ``H`` query heads, ``Hkv`` KV heads, ``q`` query rows, ``Tk`` keys, ``D`` head_dim,
``C`` the model width the output projection writes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agent_tools.capture import repeat_kv


def head_output_grams(o_weight: Tensor, num_heads: int) -> Tensor:
    """(C, H·D) output projection -> (H, D, D) per-head Gram matrices G_h = W_O^hᵀ W_O^h."""
    width, inner = o_weight.shape
    head_dim = inner // num_heads
    slices = o_weight.float().reshape(width, num_heads, head_dim).permute(1, 0, 2)  # (H, C, D)
    return slices.transpose(1, 2) @ slices  # (H, D, D)


def transformed_value_norms(value: Tensor, grams: Tensor, *, kv_groups: int) -> Tensor:
    """(B, Hkv, Tk, D) values, (H, D, D) Grams -> (B, H, Tk): ‖v_j W_O^h‖ for every query head and key."""
    heads = repeat_kv(value.float(), kv_groups)  # (B, H, Tk, D): query head h reads KV head h // groups
    squared = torch.einsum("bhtd,hde,bhte->bht", heads, grams, heads)
    return squared.clamp_min(0.0).sqrt()


def norm_shares(weighted: Tensor) -> Tensor:
    """(..., q, Tk) ‖α f(x)‖ -> each key's share of the row's total (rows summing to zero give zeros)."""
    total = weighted.sum(-1, keepdim=True)
    return torch.where(total > 0, weighted / total.clamp_min(1e-30), torch.zeros_like(weighted))


def value_share_sums(weights: Tensor, value_norms: Tensor, *, rows: Tensor | None = None) -> Tensor:
    """(h, q, k) weights, (h, k) ‖v_j W_O^h‖ -> (h, k): Σ_i of each key's share of ``Σ_j ‖α_ij v_j W_O^h‖``.

    Equals ``norm_shares(α_ij · n_j).sum(q)`` (``‖α_ij v_j W_O^h‖ = α_ij n_j``) without the (h, q, k) temporaries: with
    ``d_i = Σ_j α_ij n_j`` the sum is ``n_j · Σ_i α_ij / d_i`` (rows with ``d_i = 0`` add nothing). ``rows``
    (h, q) or (q,) weighs each row's shares (1 counts it, 0 leaves it out); None counts every row.
    """
    w = weights.float()
    norms = value_norms.float()
    totals = torch.einsum("hqk,hk->hq", w, norms)  # (h, q)
    inverse = torch.where(totals > 0, 1.0 / totals.clamp_min(1e-30), torch.zeros_like(totals))
    if rows is not None:
        inverse = inverse * rows.to(inverse.dtype)
    return torch.einsum("hq,hqk->hk", inverse, w) * norms


def projected_output_norms(head_outputs: Tensor, grams: Tensor) -> Tensor:
    """(B, H, q, D) per-head attention outputs Σ_j α_ij v_j, (H, D, D) Grams -> (B, H, q): ‖· W_O^h‖."""
    mixed = head_outputs.float()
    squared = torch.einsum("bhqd,hde,bhqe->bhq", mixed, grams, mixed)
    return squared.clamp_min(0.0).sqrt()


def head_output_norms(weights: Tensor, value: Tensor, grams: Tensor, *, kv_groups: int) -> Tensor:
    """(B, H, q, Tk), (B, Hkv, Tk, D), (H, D, D) -> (B, H, q): ‖Σ_j α_ij v_j W_O^h‖, what the head writes."""
    heads = repeat_kv(value.float(), kv_groups)  # (B, H, Tk, D)
    return projected_output_norms(weights.float() @ heads[..., : weights.shape[-1], :], grams)
