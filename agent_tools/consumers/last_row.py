"""The attention row of each layer call's last query: what the next token is chosen from, step by step.

On a prompt forward that row is the last prompt position; on a KV-cache step of greedy generation it is the
new token, so a generation keeps one (H, Tk) row per layer and step instead of the T² maps.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from agent_tools.capture import LayerAttention
from agent_tools.consumers.host import to_host


class LastRowConsumer:
    """Keeps, per layer, the attention row of the last query of each layer call: (H, Tk) per layer.

    On the prompt forward that row is the last prompt position; on a KV-cache step it is the new token.
    Call :meth:`take` after each forward to get (L, H, keys) and start afresh. Rows are kept on the CPU (one
    (H, Tk) row per layer crosses), so layers on different devices stack. A sliding-window cache holds
    only the most recent keys (the row's keys end at the query itself), so rows are aligned on the right and
    the evicted keys — which the model cannot read — get weight 0.
    """

    accepts_key_prefix: ClassVar[bool] = False

    def __init__(self) -> None:
        self._rows: dict[int, Tensor] = {}

    def on_layer(self, layer: LayerAttention) -> None:
        if not layer.last_chunk:
            return  # this chunk does not hold the call's last query row
        self._rows[layer.layer] = to_host(layer.weights[0, :, -1, :].float()).clone()  # (H, Tk)

    def take(self, keys: int | None = None) -> Tensor:
        """(L, H, keys): each layer's row, layers in order, right-aligned to ``keys`` columns (default: the longest
        row); the columns a shorter row lacks (keys a sliding window evicted) get 0. Starts afresh."""
        if not self._rows:
            raise RuntimeError("no layer was captured")
        rows = [self._rows[layer] for layer in sorted(self._rows)]
        width = keys if keys is not None else max(row.shape[-1] for row in rows)
        stacked = rows[0].new_zeros(len(rows), rows[0].shape[0], width)  # (L, H, keys)
        for index, row in enumerate(rows):
            if row.shape[-1] > width:
                raise ValueError(f"a row has {row.shape[-1]} keys, more than the {width} asked for")
            stacked[index, :, width - row.shape[-1] :] = row
        self._rows = {}
        return stacked
