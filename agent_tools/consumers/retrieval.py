"""Retrieval hits, streamed: per layer and head, where each answer-producing query looks most (Wu et al. 2024).

Keeps, for the query rows that produce an answer token, the key column each head attends most: (L, H, A) integers,
never a map. :func:`agent_tools.analysis.long_context.retrieval_hits` turns them into hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from agent_tools.capture import LayerAttention


class TopKeyConsumer:
    """The most-attended key column of every head at the given query rows, per layer (batch row 0)."""

    accepts_key_prefix: ClassVar[bool] = True  # the argmax over computed columns is the argmax: the rest weigh 0

    def __init__(self, rows: Sequence[int], num_layers: int, num_heads: int) -> None:
        self.rows = list(rows)
        self.top = torch.full((num_layers, num_heads, len(self.rows)), -1, dtype=torch.long)  # (L, H, A)

    def on_layer(self, layer: LayerAttention) -> None:
        start, count = layer.query_start, layer.weights.shape[2]
        inside = [(i, r - start) for i, r in enumerate(self.rows) if start <= r < start + count]
        if not inside:
            return
        _, columns = layer.row_max()  # (B, H, q)
        local = torch.tensor([r for _, r in inside], device=columns.device)
        picked: Tensor = columns[0, :, local].cpu()  # (H, a) key columns: positions (no cache in these passes)
        self.top[layer.layer, :, torch.tensor([i for i, _ in inside])] = picked
