"""The ``analyze`` grid: every head's map quantised, and per-head statistics, from one capture.

Maps are kept as uint8 (weight × 255, rounded) — one byte per entry — so a 60-token text over 30 × 9 heads is
about 1 MB, and the interactive HTML view can show any head without a second forward pass. The statistics are
the glossary's (:mod:`agent_tools.analysis.metrics`), averaged over every query row of sequence 0:

* ``entropy``: ``attention_entropy`` (nats; the capture's two-pass form from the softmax input);
* ``normalised_entropy``: ``normalised_from_entropy`` (entropy / ln visible keys, 0 for one key);
* ``first_token_share``: ``first_token_share`` — mean weight on key 0 over every row, row 0 included (the
  report's "sink share"; not ``profile_heads``' ``first_token`` role, which leaves out the early rows);
* ``max_weight``: ``max_weight`` — mean over rows of each row's largest weight.

Statistics are reduced on the layer's device (upcast from half precision) and only the (4, H) block of each
chunk crosses to the CPU accumulators; the quantised maps, which the interactive view asked for, cross in
:meth:`QuantisedMaps.on_layer` (one byte an entry). See :mod:`agent_tools.consumers.host`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from agent_tools.analysis.metrics import first_token_share, normalised_from_entropy, upcast
from agent_tools.capture import LayerAttention
from agent_tools.consumers.host import PendingSums


class QuantisedMaps:
    """Per-head entropy, first-token share and max weight of sequence 0, and (optionally) every map as uint8."""

    accepts_key_prefix: ClassVar[bool] = (
        True  # columns past key_width have weight 0: the zero-initialised maps already say so
    )

    def __init__(self, num_layers: int, num_heads: int, length: int, *, keep_maps: bool = True) -> None:
        self.maps = (
            torch.zeros(num_layers, num_heads, length, length, dtype=torch.uint8) if keep_maps else None
        )  # (L, H, T, T) on the CPU, like the statistics below
        # (4, L, H): mean entropy (nats), normalised entropy, weight on position 0 (every row) and max weight; each
        # statistic is a view of it, so one addition per layer fills all four
        self.means = torch.zeros(4, num_layers, num_heads)
        self.entropy, self.normalised_entropy, self.first_token_share, self.max_weight = self.means
        self.length = length
        self._pending = PendingSums()  # the current layer's statistics, on its device

    def on_layer(self, layer: LayerAttention) -> None:
        weights = layer.weights[0]  # (H, q, T) on the layer's device
        rows = slice(layer.query_start, layer.query_start + weights.shape[1])
        if self.maps is not None:
            quantised = (upcast(weights) * 255).round_().clamp_(0, 255).to(torch.uint8)
            # The one place a map crosses to the CPU: the interactive view asked for every map, as uint8.
            self.maps[layer.layer, :, rows, : layer.key_width] = quantised.cpu()
        entropy = upcast(layer.row_entropy()[0])  # (H, q) nats
        normalised = normalised_from_entropy(entropy, layer.visible_keys()[0].float())  # (H, q)
        share = weights.shape[1] / self.length  # running means over query chunks
        means = torch.stack(
            [
                entropy.mean(-1),
                normalised.mean(-1),
                first_token_share(upcast(weights[..., :1])),
                upcast(layer.row_peak()[0]).mean(-1),
            ]
        )  # (4, H) on the layer's device
        self._pending.add("means", means * share)  # this chunk's share, summed on the device
        if layer.last_chunk:  # the layer's last chunk: one copy
            self.means[:, layer.layer] += self._pending.take()["means"].float()
