"""The answer row weighted by what each key writes (Kobayashi et al. 2020), and every key's value norm.

Attention weight says what a query reads; ``‖α_j · v_j W_O^h‖`` says what actually reaches the residual stream
from key ``j``. A key read heavily whose transformed value ``v_j W_O^h`` is small (position 0, and secondary
sinks such as '.', '\\n', ' the') contributes little. This consumer keeps, per layer, the last query's row of
value-weighted shares (H, Tk) — a drop-in for :class:`~agent_tools.consumers.last_row.LastRowConsumer`'s rows —
and, from the first forward it sees (the prompt), the mean over heads of every key's ``‖v_j W_O^h‖`` (what the
filler detection compares against the text's typical token).
"""

from __future__ import annotations

import torch
from torch import Tensor

from agent_tools.analysis.attribution import value_weighted_rows
from agent_tools.analysis.norms import transformed_value_norms
from agent_tools.capture import LayerAttention
from agent_tools.consumers.host import to_host
from agent_tools.consumers.last_row import LastRowConsumer


class ValueRowConsumer(LastRowConsumer):
    """Per layer: the last query's value-weighted row (H, Tk), and the prompt's per-key value norms (Tk,).

    ``grams``: layer -> (H, D, D) output-projection Gram matrices (``consumers.collapse.output_grams_for``).
    Only the chunk holding a layer call's last query row computes anything (the value tensor holds every key in
    every chunk). Rows are taken with :meth:`take` after each forward (``LastRowConsumer``'s: right-aligned, starting
    afresh).
    """

    def __init__(self, grams: dict[int, Tensor]) -> None:
        super().__init__()
        self.grams = grams
        self.key_norms: dict[int, Tensor] = {}  # layer -> (T,) mean over heads, from the first forward

    def on_layer(self, layer: LayerAttention) -> None:
        if not layer.last_chunk:
            return
        grams = self.grams[layer.layer].to(layer.value.device)
        norms = transformed_value_norms(layer.value[:1], grams, kv_groups=layer.kv_groups)[0]  # (H, Tk)
        if layer.layer not in self.key_norms:
            self.key_norms[layer.layer] = to_host(norms.mean(0)).clone()
        row = layer.weights[0, :, -1, :]  # (H, Tk)
        self._rows[layer.layer] = to_host(value_weighted_rows(row, norms[:, -row.shape[-1] :])).clone()

    def prompt_norms(self) -> Tensor:
        """(L, T) the prompt forward's per-key value norms, mean over heads, layers in order."""
        return torch.stack([self.key_norms[layer] for layer in sorted(self.key_norms)])
