"""Per-row helpers for attention maps that are not metrics: the top keys of each row.

The metrics themselves (entropy, normalised entropy, visible keys, maximum weight) are defined once in
:mod:`agent_tools.analysis.metrics`. Shapes: ``...`` any leading dims (batch, head), ``q`` query rows, ``k`` keys.
"""

from __future__ import annotations

from torch import Tensor


def top_keys(weights: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(..., q, k) -> the ``k`` largest weights per row and their key indices, descending."""
    return weights.topk(min(k, weights.shape[-1]), dim=-1)
