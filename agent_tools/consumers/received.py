"""What each key receives from the queries that may read it, summed over heads, rows and layers."""

from __future__ import annotations

from typing import ClassVar

import torch

from agent_tools.analysis.metrics import Received, received_attention
from agent_tools.capture import LayerAttention
from agent_tools.consumers.host import HOST


class ReceivedShareConsumer:
    """What each key receives from the other queries that may read it, summed over heads, rows and layers.

    Each layer is reduced on its device; its four (Tk,) sums cross to the CPU, where the layers add up.
    """

    accepts_key_prefix: ClassVar[bool] = False

    def __init__(self, *, batch_index: int = 0) -> None:
        self.batch_index = batch_index
        self.sums: Received | None = None
        self.layers: set[int] = set()

    def on_layer(self, layer: LayerAttention) -> None:
        weights = layer.weights[self.batch_index].float()  # (H, q, Tk)
        allowed = layer.allowed()[self.batch_index, 0]  # (q, Tk)
        positions = torch.arange(weights.shape[1], device=weights.device) + layer.key_index_offset  # (q,)
        received = received_attention(weights, allowed, positions).to(HOST)
        self.sums = received if self.sums is None else self.sums + received
        self.layers.add(layer.layer)

    def received(self) -> Received:
        """Sums over layers, with ``readers`` averaged over the layers (rows that could read each key)."""
        if self.sums is None:
            raise RuntimeError("no layer was captured")
        return Received(self.sums.total, self.sums.count, self.sums.uniform, self.sums.readers / len(self.layers))
