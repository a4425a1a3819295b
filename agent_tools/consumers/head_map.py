"""One head's whole attention map of one layer, kept chunk by chunk (what show_attention reads)."""

from __future__ import annotations

from typing import ClassVar

import torch

from agent_tools.capture import LayerAttention


class HeadMapConsumer:
    """Keeps one head's rows of one layer (chunk by chunk) and nothing else."""

    accepts_key_prefix: ClassVar[bool] = False

    def __init__(self, layer: int, head: int) -> None:
        self.layer, self.head = layer, head
        self.rows: list[torch.Tensor] = []
        self.allowed: list[torch.Tensor] = []

    def on_layer(self, captured: LayerAttention) -> None:
        if captured.layer != self.layer:
            return
        self.rows.append(captured.weights[0, self.head].clone())  # (q, Tk)
        self.allowed.append(captured.allowed()[0, 0].clone())  # (q, Tk)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """After the pass: the (T, T) weights and the (T, T) mask of keys each query may read."""
        return torch.cat(self.rows), torch.cat(self.allowed)  # (T, T) each
