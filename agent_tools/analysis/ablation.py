"""Ablation effects as pure tensor functions: replacing head slices, masked means, cosine change, effect size.

The KL of next-token distributions (was ``next_token_kl``) and the next-token loss (was ``token_losses``) are
:mod:`agent_tools.analysis.metrics`' ``kl_divergence`` and ``next_token_losses``.

Shapes: ``B`` batch, ``T`` positions, ``V`` vocabulary, ``C`` hidden size, ``H`` heads, ``D`` head_dim.
Nothing here modifies its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from agent_tools.analysis.metrics import kl_divergence


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
    index = torch.tensor(list(heads), dtype=torch.long, device=hidden.device)
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


def cosine_change(a: Tensor, b: Tensor) -> Tensor:
    """(…, C) pairs -> (…,): 1 − cos(a, b); 0 = same direction, 1 = orthogonal, 2 = opposite."""
    return 1 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def effect_size(clean: Tensor, ablated: Tensor, *, language_model: bool) -> float:
    """How much an ablation changed the output, as one number.

    Causal LM: KL(clean ‖ ablated) of the next-token distribution, averaged over positions (nats);
    encoder: 1 − cos of the position-averaged last hidden states.
    """
    if language_model:
        return float(kl_divergence(clean, ablated).mean())
    return float(cosine_change(clean.mean(1), ablated.mean(1)).mean())
