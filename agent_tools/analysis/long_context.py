"""Long-context measures: the short-cache plan, KV-cache bytes, and Wu et al.'s retrieval score.

Pure functions: tensors or plain numbers in, plain numbers or tensors out; inputs never modified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# bytes per stored key or value number in the KV cache
KV_PRECISION_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def kv_cache_bytes(*, layers: int, kv_heads: int, head_dim: int, tokens: int, bytes_per_number: float) -> int:
    """Keys and values of ``kv_heads`` heads in each of ``layers`` layers for ``tokens`` tokens:
    layers × kv_heads × head_dim × 2 (K and V) × bytes × tokens."""
    return int(layers * kv_heads * head_dim * 2 * bytes_per_number * tokens)


def short_cache_saving(
    *, planned_kv_heads: int, head_dim: int, tokens: int, cache_tokens: int, bytes_per_number: float
) -> int:
    """Bytes saved when ``planned_kv_heads`` KV heads (over all layers) keep ``cache_tokens`` instead of ``tokens``."""
    kept = min(tokens, cache_tokens)
    return int(planned_kv_heads * head_dim * 2 * bytes_per_number * (tokens - kept))


@dataclass(frozen=True)
class GreedyPlan:
    """Which units get the short cache: the smallest loss changes first while their sum stays within the budget."""

    chosen: tuple[int, ...]  # unit indices, in the order they were added
    predicted: float  # Σ of the chosen units' loss changes (additivity assumed; the verified run tests it)


def greedy_plan(changes: Sequence[float], budget: float) -> GreedyPlan:
    """Add units in increasing order of their measured loss change while Σ change ≤ ``budget`` (nats).

    Units whose change is negative (the restriction helped on these texts) come first and make room for others; the
    sum is what the plan predicts when effects add up. Ties keep the units' order.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    order = sorted(range(len(changes)), key=lambda i: (changes[i], i))
    chosen: list[int] = []
    total = 0.0
    for index in order:
        if total + changes[index] > budget:
            break
        chosen.append(index)
        total += changes[index]
    return GreedyPlan(chosen=tuple(chosen), predicted=total)


def retrieval_hits(top_keys: Tensor, query_positions: Sequence[int], ids: Tensor, needle: tuple[int, int]) -> Tensor:
    """Wu et al.'s retrieval hit per head and copy step.

    ``top_keys`` (H, A): the key each head attends most from each of the A query positions that produce an answer
    token; the query at position ``p`` generates token ``ids[p + 1]``. A hit: the top key lies in the needle span
    ``[start, stop)`` and holds the token being generated. Returns (H, A) bool.
    """
    start, stop = needle
    targets = ids[torch.tensor(list(query_positions)) + 1]  # (A,)
    inside = (top_keys >= start) & (top_keys < stop)
    same = ids[top_keys.clamp(0, ids.shape[0] - 1)] == targets[None, :]
    return inside & same


def retrieval_score(hits: Tensor) -> Tensor:
    """(H, A) hits -> (H,) the share of copy steps that were hits (Wu et al. 2024's retrieval score)."""
    return hits.float().mean(-1)
