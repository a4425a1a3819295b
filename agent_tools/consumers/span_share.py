"""The attention share of one span of keys, streamed: mean over layers, heads and chosen query rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from agent_tools.capture import LayerAttention
from agent_tools.consumers.host import PendingSums, accumulation_dtype


class SpanShareConsumer:
    """Σ_{j ∈ span} A[i, j] for the query rows ``rows``, averaged over every layer, head and row (batch row 0)."""

    accepts_key_prefix: ClassVar[bool] = True  # keys past key_width weigh 0 for these rows

    def __init__(self, rows: Sequence[int], span: Sequence[int]) -> None:
        self.rows = list(rows)
        self.span = list(span)
        self.total = 0.0
        self.count = 0
        self._pending = PendingSums()  # the current layer's total, on its device

    def on_layer(self, layer: LayerAttention) -> None:
        start, count = layer.query_start, layer.weights.shape[2]
        local = [r - start for r in self.rows if start <= r < start + count]
        keys = [j for j in self.span if j < layer.key_width]
        if local:
            weights = layer.weights[0][:, torch.tensor(local, device=layer.weights.device)]  # (H, a, Tk)
            if keys:
                picked = weights[..., torch.tensor(keys, device=weights.device)].float().sum(-1)  # (H, a)
                self._pending.add("total", picked.sum(dtype=accumulation_dtype(picked.device)))
            self.count += weights.shape[0] * weights.shape[1]
        if start + count == layer.query_length and self._pending:  # the layer's last chunk: one copy
            self.total += float(self._pending.take()["total"])

    @property
    def share(self) -> float:
        return self.total / self.count if self.count else 0.0
