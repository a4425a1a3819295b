"""One query row of one layer's head-averaged attention: the raw attention a rollout is compared against."""

from __future__ import annotations

from typing import ClassVar

import torch

from agent_tools.capture import LayerAttention
from agent_tools.consumers.host import to_host


class TargetRowConsumer:
    """Keeps the target row of one layer's head-averaged attention (chunk-aware), on the CPU; nothing else."""

    accepts_key_prefix: ClassVar[bool] = False  # keeps every key column of the row

    def __init__(self, layer: int, position: int) -> None:
        self.layer, self.position = layer, position
        self.row: torch.Tensor | None = None

    def on_layer(self, captured: LayerAttention) -> None:
        if captured.layer != self.layer:
            return
        local = self.position - captured.key_index_offset
        if 0 <= local < captured.weights.shape[2]:
            self.row = to_host(captured.weights[0, :, local].float().mean(0)).clone()  # (Tk,)
