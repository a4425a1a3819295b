"""Where consumers compute and where they keep: one rule for every consumer.

* A layer's statistics are computed where the layer runs — the device of ``layer.weights`` (under an
  accelerate device map, a different GPU per layer) — and index tensors are made there too
  (``torch.arange(..., device=weights.device)``).
* Accumulators live on the CPU. Each layer (or query chunk) moves its small results — per-head and per-key
  vectors, stacked so one transfer carries several — with :func:`to_host`; a (q, Tk) map never crosses. So
  totals over layers on different GPUs add up, and what a consumer hands its caller is a plain CPU tensor.
* Consumers whose job is to keep maps say where they keep them: ``HeadMapConsumer`` and the ``analyze`` grid move
  the maps their callers asked for to the CPU in one named place; ``RolloutConsumer`` and ``HeadInputsConsumer``
  keep theirs on the layer's device, where the rest of their computation runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

HOST = torch.device("cpu")


def to_host(tensor: Tensor) -> Tensor:
    """A small per-layer result (per-head or per-key numbers, never a map) on the CPU; no copy on the CPU."""
    return tensor.to(HOST)
