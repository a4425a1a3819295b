"""Attention rollout (Abnar & Zuidema 2020): how much each input token flows into each position.

Per layer the head-averaged map Ā is mixed with the identity for the residual stream,
Â = r·I + (1 − r)·Ā (r = 0.5 in the paper), rows renormalised, and the layers are multiplied through:
R = Â_L ··· Â_2 · Â_1. Row i of R says how the input tokens feed position i at the top of the stack.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agent_tools.capture import LayerAttention


def residual_mix(head_mean: Tensor, residual: float = 0.5) -> Tensor:
    """(T, T) head-averaged map -> (T, T) Â = r·I + (1 − r)·Ā with rows summing to 1."""
    length = head_mean.shape[-1]
    mixed = residual * torch.eye(length, dtype=head_mean.dtype) + (1 - residual) * head_mean
    return mixed / mixed.sum(-1, keepdim=True)


def attention_rollout(head_means: list[Tensor], *, residual: float = 0.5) -> Tensor:
    """Layers' (T, T) head-averaged maps, bottom first -> (T, T) rollout; rows sum to 1."""
    if not head_means:
        raise ValueError("rollout needs at least one layer")
    result = residual_mix(head_means[0], residual)
    for head_mean in head_means[1:]:
        result = residual_mix(head_mean, residual) @ result
    return result


class RolloutConsumer:
    """Streams rollout through the layers of one sequence: holds one (T, T) matrix, never all layers' maps.

    Works with query chunks: rows of a layer are assembled before the layer is multiplied in.
    """

    def __init__(self, *, residual: float = 0.5, batch_index: int = 0) -> None:
        self.residual = residual
        self.batch_index = batch_index
        self.result: Tensor | None = None
        self._rows: list[Tensor] = []
        self._layer: int | None = None

    def on_layer(self, layer: LayerAttention) -> None:
        if self._layer is not None and layer.layer != self._layer:
            self._flush()
        self._layer = layer.layer
        self._rows.append(layer.weights[self.batch_index].float().mean(0))  # (q, T) averaged over heads
        if layer.query_start + layer.weights.shape[2] == layer.query_length:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        mixed = residual_mix(torch.cat(self._rows), self.residual)  # (T, T)
        self.result = mixed if self.result is None else mixed @ self.result
        self._rows, self._layer = [], None

    def rollout(self) -> Tensor:
        self._flush()
        if self.result is None:
            raise RuntimeError("no layer was captured")
        return self.result
