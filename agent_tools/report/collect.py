"""Consumers that keep what the report needs from one capture: every head's map, quantised, and per-head stats.

Maps are kept as uint8 (weight × 255, rounded) — one byte per entry — so a 60-token text over 30 × 9 heads is
about 1 MB, and the interactive HTML view can show any head without a second forward pass.
"""

from __future__ import annotations

import torch

from agent_tools.capture import LayerAttention


class QuantisedMaps:
    """Per-head entropy, sink share and max weight of sequence 0, and (optionally) every map as uint8."""

    accepts_key_prefix = True  # columns past key_width have weight 0: the zero-initialised maps already say so

    def __init__(self, num_layers: int, num_heads: int, length: int, *, keep_maps: bool = True) -> None:
        self.maps = (
            torch.zeros(num_layers, num_heads, length, length, dtype=torch.uint8) if keep_maps else None
        )  # (L, H, T, T)
        self.entropy = torch.zeros(num_layers, num_heads)  # mean nats per head
        self.normalised_entropy = torch.zeros(num_layers, num_heads)
        self.sink_share = torch.zeros(num_layers, num_heads)  # mean weight on position 0
        self.max_weight = torch.zeros(num_layers, num_heads)
        self.length = length

    def on_layer(self, layer: LayerAttention) -> None:
        weights = layer.weights[0]  # (H, q, T)
        rows = slice(layer.query_start, layer.query_start + weights.shape[1])
        if self.maps is not None:
            self.maps[layer.layer, :, rows, : layer.key_width] = (weights * 255).round_().clamp_(0, 255).to(torch.uint8)
        entropy = layer.row_entropy()[0]  # (H, q) nats
        count = layer.visible_keys()[0].float()  # (1, q)
        normalised = torch.where(count > 1, entropy / count.clamp_min(2).log(), torch.zeros_like(entropy))
        share = weights.shape[1] / self.length  # running means over query chunks
        self.entropy[layer.layer] += entropy.mean(-1) * share
        self.normalised_entropy[layer.layer] += normalised.mean(-1) * share
        self.sink_share[layer.layer] += weights[..., 0].mean(-1) * share
        self.max_weight[layer.layer] += layer.row_peak()[0].mean(-1) * share
