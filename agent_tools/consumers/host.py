"""Where consumers compute and where they keep: one rule for every consumer.

* A layer's statistics are computed where the layer runs — the device of ``layer.weights`` (under an
  accelerate device map, a different GPU per layer) — and index tensors are made there too
  (``torch.arange(..., device=weights.device)``).
* Accumulators live on the CPU. Each layer (or query chunk) moves its small results — per-head and per-key
  vectors, stacked so one transfer carries several — with :func:`to_host`; a (q, Tk) map never crosses. So
  totals over layers on different GPUs add up, and what a consumer hands its caller is a plain CPU tensor.
* Nothing is read back per query chunk: a consumer adds a chunk's sums on the device and moves a layer's sums
  once, at its last chunk, so a pass synchronises with the host O(layers) times, not O(chunks).
* Sums kept on an accelerator are float32 (:func:`accumulation_dtype`; float64 runs at 1/2 to 1/64 of the speed
  there); on the CPU they are float64. What crosses is added to float64 totals on the CPU.
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


ACCELERATOR_SUMS = torch.float32  # the dtype of sums kept on an accelerator (float64 runs at 1/2 to 1/64 there)


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """The dtype of running sums kept on ``device``: float64 on the CPU, :data:`ACCELERATOR_SUMS` elsewhere."""
    return torch.float64 if device.type == "cpu" else ACCELERATOR_SUMS


class PendingSums:
    """One layer's running sums, kept on the device across its query chunks and moved to the CPU in one copy.

    ``add`` sums a named block, ``minimum`` keeps a running minimum, ``first`` keeps the first block given (a
    per-layer value every chunk repeats); :meth:`take` moves every block in one device-to-host copy and returns
    them as float64 CPU tensors (their shapes kept), then starts afresh.
    """

    def __init__(self) -> None:
        self._blocks: dict[str, Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self._blocks)

    def add(self, name: str, block: Tensor) -> None:
        previous = self._blocks.get(name)
        self._blocks[name] = block if previous is None else previous + block

    def minimum(self, name: str, block: Tensor) -> None:
        previous = self._blocks.get(name)
        self._blocks[name] = block if previous is None else torch.minimum(previous, block)

    def first(self, name: str, block: Tensor) -> None:
        self._blocks.setdefault(name, block)

    def take(self) -> dict[str, Tensor]:
        """name -> float64 CPU tensor; one copy for every block (none when nothing was added)."""
        if not self._blocks:
            return {}
        names = list(self._blocks)
        blocks = [self._blocks[name] for name in names]
        dtype = accumulation_dtype(blocks[0].device)
        flat = torch.cat([block.reshape(-1).to(dtype) for block in blocks])
        moved = to_host(flat).double()  # the one device-to-host copy
        self._blocks = {}
        parts = moved.split([block.numel() for block in blocks])
        return {name: part.view(block.shape) for name, part, block in zip(names, parts, blocks, strict=True)}
