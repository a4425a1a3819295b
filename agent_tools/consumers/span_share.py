"""The attention share of one span of keys, streamed: mean over layers, heads and chosen query rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from agent_tools.capture import LayerAttention


class SpanShareConsumer:
    """Σ_{j ∈ span} A[i, j] for the query rows ``rows``, averaged over every layer, head and row (batch row 0)."""

    accepts_key_prefix: ClassVar[bool] = True  # keys past key_width weigh 0 for these rows

    def __init__(self, rows: Sequence[int], span: Sequence[int]) -> None:
        self.rows = list(rows)
        self.span = list(span)
        self.total = 0.0
        self.count = 0

    def on_layer(self, layer: LayerAttention) -> None:
        start, count = layer.query_start, layer.weights.shape[2]
        local = [r - start for r in self.rows if start <= r < start + count]
        keys = [j for j in self.span if j < layer.key_width]
        if not local:
            return
        weights = layer.weights[0][:, torch.tensor(local, device=layer.weights.device)]  # (H, a, Tk)
        if keys:
            picked = weights[..., torch.tensor(keys, device=weights.device)].float().sum(-1)  # (H, a)
            self.total += float(picked.sum())
        self.count += weights.shape[0] * weights.shape[1]

    @property
    def share(self) -> float:
        return self.total / self.count if self.count else 0.0
