"""How one query row's attention splits over the segments of a prompt: pure functions over small tensors.

Shapes: ``L`` layers, ``H`` heads, ``q`` query rows, ``Tk`` keys, ``S`` segments, ``V`` vocabulary.
``segment_index`` is a (Tk,) long tensor giving each key's segment (0..S-1). Nothing is modified in place.
What keys receive (``received_attention``), the sink threshold (``threshold_sinks``, was ``find_sinks``), the
shares without the sink (``without_sink``) and the KL divergence are defined in :mod:`agent_tools.analysis.metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def segment_shares(weights: Tensor, segment_index: Tensor, num_segments: int) -> Tensor:
    """(..., Tk) attention rows -> (..., S): the weight each segment receives (rows summing to 1 give shares)."""
    if weights.shape[-1] != segment_index.shape[0]:
        msg = f"weights have {weights.shape[-1]} keys but segment_index has {segment_index.shape[0]}"
        raise ValueError(msg)
    shares = weights.new_zeros(*weights.shape[:-1], num_segments)
    return shares.index_add(-1, segment_index.to(weights.device), weights)


@dataclass(frozen=True)
class Lead:
    """The segment read most among the eligible ones, the runner-up, and the margin between them."""

    best: int
    runner_up: int | None
    margin: float  # best share - runner-up share (the best share itself when there is no runner-up)


def leading_segment(shares: Tensor, eligible: Tensor) -> Lead:
    """(S,) shares and (S,) bool eligibility -> the top eligible segment, the next one and the margin."""
    candidates = torch.nonzero(eligible).flatten()
    if candidates.numel() == 0:
        raise ValueError("no eligible segment")
    ranked = candidates[shares[candidates].argsort(descending=True, stable=True)]
    best = int(ranked[0])
    if ranked.numel() == 1:
        return Lead(best, None, float(shares[best]))
    runner_up = int(ranked[1])
    return Lead(best, runner_up, float(shares[best] - shares[runner_up]))


def top_positions(token_weights: Tensor, positions: list[int], k: int) -> list[tuple[int, float]]:
    """(Tk,) weights -> the ``k`` positions among ``positions`` with the largest weight, descending."""
    if not positions:
        return []
    index = torch.tensor(positions, dtype=torch.long, device=token_weights.device)
    values = token_weights[index]
    order = values.argsort(descending=True, stable=True)[:k]
    return [(positions[int(i)], float(values[i])) for i in order]


def share_changes(
    before: dict[str, float | None], after: dict[str, float | None]
) -> list[tuple[str, float | None, float | None, float]]:
    """Segment shares of two variants matched by name -> (name, before, after, change), largest |change| first.

    A segment missing from one variant counts as 0 there for the change (its share stays ``None``).
    """
    names = list(before) + [n for n in after if n not in before]
    rows = []
    for name in names:
        a, b = before.get(name), after.get(name)
        rows.append((name, a, b, (b or 0.0) - (a or 0.0)))
    return sorted(rows, key=lambda row: -abs(row[3]))
