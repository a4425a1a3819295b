"""Attention rollout, streamed through the layers of one sequence (Abnar & Zuidema 2020).

The mixing and the product are :mod:`agent_tools.analysis.rollout`'s; this consumer assembles each layer's
head-averaged rows over query chunks and multiplies the layer in, holding one (T, T) matrix. The product stays
on the device of the last layer multiplied in (under a device map it follows the layers from GPU to GPU); callers
move the rows they read.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from agent_tools.analysis.rollout import residual_mix
from agent_tools.capture import LayerAttention


class RolloutConsumer:
    """Streams rollout through the layers of one sequence: holds one (T, T) matrix, never all layers' maps.

    Works with query chunks: rows of a layer are assembled before the layer is multiplied in.
    """

    accepts_key_prefix: ClassVar[bool] = False

    def __init__(self, *, residual: float = 0.5) -> None:
        self.residual = residual
        self.result: Tensor | None = None
        self._rows: list[Tensor] = []
        self._layer: int | None = None

    def on_layer(self, layer: LayerAttention) -> None:
        if self._layer is not None and layer.layer != self._layer:
            self._flush()
        self._layer = layer.layer
        self._rows.append(layer.weights[0].float().mean(0))  # (q, T) averaged over heads
        if layer.last_chunk:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        mixed = residual_mix(torch.cat(self._rows), self.residual)  # (T, T) on this layer's device
        self.result = mixed if self.result is None else mixed @ self.result.to(mixed.device)
        self._rows, self._layer = [], None

    def rollout(self) -> Tensor:
        """(T, T) the rollout, on the device of the last layer captured."""
        self._flush()
        if self.result is None:
            raise RuntimeError("no layer was captured")
        return self.result
