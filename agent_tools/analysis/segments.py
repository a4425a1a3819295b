"""How one query row's attention splits over the segments of a prompt: pure functions over small tensors.

Shapes: ``L`` layers, ``H`` heads, ``q`` query rows, ``Tk`` keys, ``S`` segments, ``V`` vocabulary.
``segment_index`` is a (Tk,) long tensor giving each key's segment (0..S-1). Nothing is modified in place.
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
class Received:
    """What each key receives from the other queries that may read it, summed over heads, rows (and layers).

    ``total``: weight received; ``count``: (head, row) pairs that could read the key; ``uniform``: what those
    pairs would give it if every row spread evenly over its visible keys; ``readers``: rows that could read it.
    All (Tk,). ``total / count`` is the mean share received, ``uniform / count`` the uniform expectation.
    """

    total: Tensor
    count: Tensor
    uniform: Tensor
    readers: Tensor

    def __add__(self, other: Received) -> Received:
        return Received(
            self.total + other.total,
            self.count + other.count,
            self.uniform + other.uniform,
            self.readers + other.readers,
        )


def received_attention(weights: Tensor, allowed: Tensor, query_positions: Tensor) -> Received:
    """One layer's rows -> what each key receives from the other queries (a query's weight on itself excluded).

    Args:
        weights: (H, q, Tk) one layer's attention rows.
        allowed: (q, Tk) bool, which keys each row may read.
        query_positions: (q,) the key column of each query row (its own position).
    """
    heads = weights.shape[0]
    keys = torch.arange(weights.shape[-1], device=weights.device)
    readers = allowed & (keys[None, :] != query_positions[:, None])  # (q, Tk): other queries that may read
    visible = allowed.sum(-1, keepdim=True).clamp_min(1)  # (q, 1) keys each row spreads over
    return Received(
        total=(weights * readers[None]).sum((0, 1)),  # (Tk,)
        count=readers.sum(0) * heads,  # (Tk,)
        uniform=(readers / visible).sum(0) * heads,  # (Tk,)
        readers=readers.sum(0),  # (Tk,)
    )


def find_sinks(
    received: Received,
    *,
    threshold: float,
    min_readers: int = 4,
    min_ratio: float = 2.0,
    always: tuple[int, ...] = (0,),
) -> list[int]:
    """Sink positions: ``always`` (the first token) plus tokens read heavily whatever the query.

    A token is a sink when at least ``min_readers`` later queries could read it and, averaged over those
    queries, all heads and layers, it receives at least ``threshold`` of their attention and at least
    ``min_ratio`` times what uniform attention would give it (which keeps short texts, where every share is
    large, from calling every token a sink).
    """
    count = received.count.clamp_min(1)
    mean, uniform = received.total / count, received.uniform / count  # (T,) each
    heavy = (received.readers >= min_readers) & (mean >= threshold) & (mean >= min_ratio * uniform)
    found = {p for p in always if 0 <= p < mean.shape[0]}
    found |= {int(p) for p in torch.nonzero(heavy).flatten().tolist()}
    return sorted(found)


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
    index = torch.tensor(positions, dtype=torch.long)
    values = token_weights[index]
    order = values.argsort(descending=True, stable=True)[:k]
    return [(positions[int(i)], float(values[i])) for i in order]


def without_sink(shares: Tensor, sink: int | None) -> Tensor:
    """(..., S) shares -> shares renormalised over every segment but the sink (the sink's entry becomes 0)."""
    if sink is None:
        return shares
    kept = shares.clone()
    kept[..., sink] = 0
    return kept / kept.sum(-1, keepdim=True).clamp_min(1e-12)


def kl_divergence(logits_p: Tensor, logits_q: Tensor) -> float:
    """(V,) logits of P and Q -> KL(P ‖ Q) in nats, computed from log-softmax for stability."""
    log_p = torch.log_softmax(logits_p.double(), -1)
    log_q = torch.log_softmax(logits_q.double(), -1)
    return float((log_p.exp() * (log_p - log_q)).sum().clamp_min(0.0))


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
