"""Ablation effects as pure tensor functions: replacing head slices, KL of next-token distributions, loss, cosine.

Shapes: ``B`` batch, ``T`` positions, ``V`` vocabulary, ``C`` hidden size, ``H`` heads, ``D`` head_dim.
Nothing here modifies its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def replace_head_slices(hidden: Tensor, heads: Sequence[int], head_dim: int, means: Tensor | None = None) -> Tensor:
    """(..., H·D) concatenated head outputs -> a copy with the named heads' slices zeroed or set to their mean.

    Args:
        hidden: the input of the output projection; head ``h`` owns features ``h·D .. (h+1)·D − 1``.
        heads: query heads to ablate.
        head_dim: ``D``.
        means: (H, D) per-head mean output to substitute (mean ablation); ``None`` zeroes (zero ablation).
    """
    shape = hidden.shape
    num_heads = shape[-1] // head_dim
    per_head = hidden.reshape(*shape[:-1], num_heads, head_dim).clone()  # (..., H, D)
    index = torch.tensor(list(heads), dtype=torch.long)
    if means is None:
        per_head[..., index, :] = 0
    else:
        per_head[..., index, :] = means[index].to(hidden.dtype)
    return per_head.reshape(shape)  # (..., H·D)


def masked_mean(hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """(B, T, F), mask (B, T) -> (F,): the mean over every unmasked position of every sequence."""
    flat = hidden.double()
    if attention_mask is None:
        return flat.mean(dim=(0, 1)).to(hidden.dtype)
    weights = attention_mask.to(flat.dtype)[..., None]  # (B, T, 1)
    return ((flat * weights).sum(dim=(0, 1)) / weights.sum().clamp_min(1)).to(hidden.dtype)


def next_token_kl(clean_logits: Tensor, ablated_logits: Tensor) -> Tensor:
    """(…, V) logits -> (…,): KL(P_clean ‖ P_ablated) in nats per position (0 when the logits are equal)."""
    clean = torch.log_softmax(clean_logits.double(), dim=-1)
    ablated = torch.log_softmax(ablated_logits.double(), dim=-1)
    return (clean.exp() * (clean - ablated)).sum(-1).clamp_min(0.0)


def token_losses(logits: Tensor, input_ids: Tensor) -> Tensor:
    """(B, T, V), (B, T) -> (B, T−1): cross-entropy in nats of each next token given the logits before it."""
    log_probs = torch.log_softmax(logits[:, :-1].double(), dim=-1)  # (B, T-1, V)
    return -log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def cosine_change(a: Tensor, b: Tensor) -> Tensor:
    """(…, C) pairs -> (…,): 1 − cos(a, b); 0 = same direction, 1 = orthogonal, 2 = opposite."""
    return 1 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)
