"""One head's whole attention map of one layer, kept chunk by chunk (what show_attention reads)."""

from __future__ import annotations

from typing import ClassVar

import torch

from agent_tools.capture import LayerAttention


class HeadMapConsumer:
    """Keeps one head's rows of one layer (chunk by chunk, on the layer's device) and nothing else."""

    accepts_key_prefix: ClassVar[bool] = False

    def __init__(self, layer: int, head: int) -> None:
        self.layer, self.head = layer, head
        self.rows: list[torch.Tensor] = []
        self.allowed: list[torch.Tensor] = []

    def on_layer(self, captured: LayerAttention) -> None:
        if captured.layer != self.layer:
            return
        # a float32 copy whatever the model's dtype: entropies and means of bf16 rows lose ~1e-2 nats
        self.rows.append(captured.weights[0, self.head].to(torch.float32, copy=True))  # (q, Tk)
        self.allowed.append(captured.allowed()[0, 0].clone())  # (q, Tk)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """After the pass: the (T, T) weights and the (T, T) mask of keys each query may read, on the CPU."""
        # The one place this map crosses to the CPU: the caller asked for it (show_attention lists and draws it).
        return torch.cat(self.rows).cpu(), torch.cat(self.allowed).cpu()  # (T, T) each
