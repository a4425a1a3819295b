"""Attention rollout (Abnar & Zuidema 2020): how much each input token flows into each position.

Per layer the head-averaged map Ā is mixed with the identity for the residual stream,
Â = r·I + (1 − r)·Ā (r = 0.5 in the paper), rows renormalised, and the layers are multiplied through:
R = Â_L ··· Â_2 · Â_1. Row i of R says how the input tokens feed position i at the top of the stack.

The streamed version (``RolloutConsumer``, one (T, T) matrix held) lives in :mod:`agent_tools.consumers.rollout`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def residual_mix(head_mean: Tensor, residual: float = 0.5) -> Tensor:
    """(T, T) head-averaged map -> (T, T) Â = r·I + (1 − r)·Ā with rows summing to 1."""
    length = head_mean.shape[-1]
    mixed = residual * torch.eye(length, dtype=head_mean.dtype, device=head_mean.device) + (1 - residual) * head_mean
    return mixed / mixed.sum(-1, keepdim=True)


def attention_rollout(head_means: list[Tensor], *, residual: float = 0.5) -> Tensor:
    """Layers' (T, T) head-averaged maps, bottom first -> (T, T) rollout; rows sum to 1."""
    if not head_means:
        raise ValueError("rollout needs at least one layer")
    result = residual_mix(head_means[0], residual)
    for head_mean in head_means[1:]:
        result = residual_mix(head_mean, residual) @ result
    return result
