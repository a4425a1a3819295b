"""Every decoder row of a cross-attention pass, per layer: which input token each answer token read.

A teacher-forced pass over an encoder–decoder's answer has one query row per answer token; each row reads the
encoder's positions. The consumer keeps those rows, (H, q, Tk) per layer on the CPU (answers are short), and
what every input token received from the rows (to find the input's attention sinks of the cross-attention).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from agent_tools.analysis.metrics import Received, received_attention
from agent_tools.capture import LayerAttention
from agent_tools.consumers.host import HOST, to_host
from agent_tools.consumers.received import over_layers


class CrossRowsConsumer:
    """Keeps each layer's cross-attention rows (chunk by chunk) and what each encoder key received from them."""

    accepts_key_prefix: ClassVar[bool] = False

    def __init__(self) -> None:
        self._rows: dict[int, list[Tensor]] = {}
        self.sums: Received | None = None

    def on_layer(self, layer: LayerAttention) -> None:
        weights = layer.weights[0].float()  # (H, q, Tk)
        self._rows.setdefault(layer.layer, []).append(to_host(weights).clone())
        allowed = layer.allowed()[0, 0]  # (q, Tk)
        # no key is the query itself: the keys are the input's positions, the queries the answer's
        nobody = torch.full((weights.shape[1],), -1, dtype=torch.long, device=weights.device)
        received = received_attention(weights, allowed, nobody).to(HOST)
        self.sums = received if self.sums is None else self.sums + received

    def rows(self) -> Tensor:
        """(L, H, q, Tk) every layer's rows, in layer order."""
        if not self._rows:
            raise RuntimeError("no layer was captured")
        return torch.stack([torch.cat(self._rows[layer], dim=1) for layer in sorted(self._rows)])

    def received(self) -> Received:
        return over_layers(self.sums, len(self._rows))
