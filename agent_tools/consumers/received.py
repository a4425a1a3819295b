"""What each key receives from the queries that may read it, summed over heads, rows and layers."""

from __future__ import annotations

from typing import ClassVar

import torch

from agent_tools.analysis.metrics import Received, received_attention
from agent_tools.capture import LayerAttention
from agent_tools.consumers.host import PendingSums, accumulation_dtype


class ReceivedShareConsumer:
    """What each key receives from the other queries that may read it, summed over heads, rows and layers.

    Each chunk is reduced on its layer's device and added there; at a layer's last chunk its four (Tk,) sums cross to
    the CPU in one copy, where the layers add up.
    """

    accepts_key_prefix: ClassVar[bool] = False

    def __init__(self) -> None:
        self.sums: Received | None = None
        self.layers: set[int] = set()
        self._pending = PendingSums()  # the current layer's sums, on its device

    def on_layer(self, layer: LayerAttention) -> None:
        weights = layer.weights[0].float()  # (H, q, Tk)
        allowed = layer.allowed()[0, 0]  # (q, Tk)
        positions = torch.arange(weights.shape[1], device=weights.device) + layer.key_index_offset  # (q,)
        received = received_attention(weights, allowed, positions)
        dtype = accumulation_dtype(weights.device)
        parts = (received.total, received.count, received.uniform, received.readers)
        self._pending.add("received", torch.stack([part.to(dtype) for part in parts]))  # (4, Tk)
        self.layers.add(layer.layer)
        if layer.last_chunk:
            total, count, uniform, readers = self._pending.take()["received"]  # (4, Tk): one copy per layer
            moved = Received(total.float(), count.round().long(), uniform.float(), readers.round().long())
            self.sums = moved if self.sums is None else self.sums + moved

    def received(self) -> Received:
        return over_layers(self.sums, len(self.layers))


def over_layers(sums: Received | None, layers: int) -> Received:
    """Sums over ``layers`` layers, with ``readers`` averaged over them (rows that could read each key)."""
    if sums is None:
        raise RuntimeError("no layer was captured")
    return Received(sums.total, sums.count, sums.uniform, sums.readers / layers)
