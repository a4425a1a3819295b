"""Basic per-row measures of attention maps: entropy, visible keys, concentration, top keys.

Shapes: ``...`` any leading dims (batch, head), ``q`` query rows, ``k`` keys. ``allowed`` is a bool tensor
broadcastable to the weights that marks which keys each query may read (causal and padding masks).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_entropy(weights: Tensor) -> Tensor:
    """(..., q, k) -> (..., q): Shannon entropy in nats, with 0·log 0 = 0."""
    if weights.requires_grad:  # entr's gradient at p = 0 is −log 0: keep the where-form, whose gradient is 0 there
        logs = torch.where(weights > 0, weights.clamp_min(1e-30).log(), torch.zeros_like(weights))
        return (-(weights * logs).sum(-1)).clamp_min(0.0)
    return torch.special.entr(weights).sum(-1).clamp_min(0.0)  # entr(p) = −p log p, entr(0) = 0: one pass


def visible_keys(allowed: Tensor, shape: torch.Size | None = None) -> Tensor:
    """(..., q, k) bool -> (..., q): how many keys each query may read."""
    count = allowed.sum(-1)  # before broadcasting: the heads share one mask
    return count.expand(shape[:-1]) if shape is not None else count


def normalised_entropy(weights: Tensor, allowed: Tensor | None = None) -> Tensor:
    """(..., q, k) -> (..., q): entropy / log(keys visible to the row), in [0, 1]; rows with one key give 0."""
    entropy = attention_entropy(weights)
    if allowed is None:
        count = torch.full_like(entropy, weights.shape[-1])
    else:
        count = visible_keys(allowed, weights.shape).to(entropy.dtype)
    denominator = count.clamp_min(1).log()
    return torch.where(count > 1, entropy / denominator.clamp_min(1e-12), torch.zeros_like(entropy))


def max_weight(weights: Tensor) -> tuple[Tensor, Tensor]:
    """(..., q, k) -> values (..., q), argmax key (..., q)."""
    return weights.max(-1)


def top_keys(weights: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(..., q, k) -> the ``k`` largest weights per row and their key indices, descending."""
    return weights.topk(min(k, weights.shape[-1]), dim=-1)


def uniform_entropy(count: int) -> float:
    """Entropy of a uniform row over ``count`` keys (the maximum), in nats."""
    return math.log(count) if count > 1 else 0.0
