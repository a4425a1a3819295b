"""Edge attribution (EAP-IG, Hanna et al. 2024) as pure functions: interpolation points, edge scores, curve sizes.

An edge u -> v is scored ``(a_u,clean − a_u,corrupted) · mean_α ∂M/∂x_v(α)``: the difference of what sender ``u``
writes into the residual stream between the clean and the corrupted run, times the gradient of the metric with
respect to the residual stream *as receiver v reads it* (one head's queries, keys or values, or the logits),
averaged over the interpolation points α between the corrupted (α = 0) and the clean (α = 1) input embeddings.
Positive: the edge carries the metric toward the clean answer. Sign convention: clean − corrupted (the
first-order logit difference the edge restores), the opposite of EAP's corrupted − clean.

Tensors in, tensors out; float64 sums. Shapes: ``S`` senders, ``R`` receivers, ``T`` positions, ``C`` width.
"""

from __future__ import annotations

import torch
from torch import Tensor


def interpolation_points(steps: int) -> Tensor:
    """(steps,) midpoints α_k = (k + ½) / steps of [0, 1] (a midpoint Riemann sum of the path integral)."""
    if steps < 1:
        raise ValueError("at least one interpolation step")
    return (torch.arange(steps, dtype=torch.float64) + 0.5) / steps


def edge_scores(deltas: Tensor, gradients: Tensor) -> Tensor:
    """(S, T, C) sender write differences and (R, T, C) receiver gradients -> (S, R) Σ_T,C Δ · ∂M/∂x."""
    return deltas.double().flatten(1) @ gradients.double().flatten(1).T


def curve_sizes(count: int, *, dense: int = 8) -> list[int]:
    """Edge-set sizes at which faithfulness is measured: 1..dense, then ×1.5 steps, ending at ``count``."""
    sizes = list(range(1, min(dense, count) + 1))
    size = float(sizes[-1]) if sizes else 0.0
    while sizes and sizes[-1] < count:
        size = max(size * 1.5, sizes[-1] + 1)
        sizes.append(min(count, round(size)))
    return sizes
