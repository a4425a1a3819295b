"""Long-context measures: the short-cache plan, KV-cache bytes, and Wu et al.'s retrieval score.

Pure functions: tensors or plain numbers in, plain numbers or tensors out; inputs never modified.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
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


@dataclass(frozen=True)
class PlanStep:
    """One verifying run of :func:`verified_greedy`: heads added to the plan so far, and what was predicted for it."""

    added: tuple[int, ...]  # unit indices tried in this run (on top of the plan accepted before it)
    predicted: float  # the plan's verified change before the run + Σ of the added units' own changes
    verified: float  # the change measured with the plan and the added units restricted at once
    agreement: float  # top-token agreement of that run
    accepted: bool  # within the budget and within the tolerance of the prediction


@dataclass(frozen=True)
class VerifiedPlan:
    """A plan built in verified groups: every accepted group's joint change agreed with its prediction."""

    chosen: tuple[int, ...]  # unit indices, in the order they were accepted
    predicted: float  # the last accepted step's prediction (0 for an empty plan)
    verified: float  # the last accepted step's verified change (0 for an empty plan)
    agreement: float  # its top-token agreement (1 for an empty plan)
    additive: float  # Σ of the chosen units' own changes (what adding single-head effects would predict)
    steps: tuple[PlanStep, ...]


def verified_greedy(
    changes: Sequence[float],
    budget: float,
    tolerance: float,
    verify: Callable[[Sequence[int]], tuple[float, float]],
    *,
    max_runs: int,
) -> VerifiedPlan:
    """Greedy in groups, each verified before it is accepted, so the plan's prediction is a checked one.

    Units are taken in increasing order of their own ``changes`` (as :func:`greedy_plan`). A step adds the next group
    to the accepted plan: the largest prefix of the group whose predicted change — the plan's *verified* change plus
    the group's own changes — fits the ``budget``; ``verify(units)`` runs the plan with those units restricted at
    once and returns (loss change, top-token agreement). The group is accepted when the verified change fits the
    budget and lies within ``tolerance`` of the prediction; then the next group is twice its size. A rejected group
    is halved and retried; a rejected single unit is skipped (its effect, joined to the plan, is not its own). The
    first group is the whole additive plan (one run when effects add up). Stops when the next unit alone is predicted
    over the budget, when every unit was tried, or after ``max_runs`` runs.
    """
    if budget < 0 or tolerance < 0:
        raise ValueError(f"budget and tolerance must be >= 0, got {budget}, {tolerance}")
    order = sorted(range(len(changes)), key=lambda i: (changes[i], i))
    plan: list[int] = []
    predicted, verified, agreement = 0.0, 0.0, 1.0
    steps: list[PlanStep] = []
    at, size = 0, max(1, len(greedy_plan(changes, budget).chosen))
    while at < len(order) and len(steps) < max_runs:
        group: list[int] = []
        guess = verified
        for index in order[at : at + size]:
            if guess + changes[index] > budget:
                break
            group.append(index)
            guess += changes[index]
        if not group:
            break  # the next unit alone is predicted over the budget; later units change the loss more
        change, agree = verify([*plan, *group])
        accepted = change <= budget and abs(change - guess) <= tolerance
        steps.append(PlanStep(tuple(group), guess, change, agree, accepted))
        if accepted:
            plan.extend(group)
            predicted, verified, agreement = guess, change, agree
            at += len(group)
            size = 2 * len(group)
        elif len(group) > 1:
            size = len(group) // 2
        else:
            at += 1
    additive = math.fsum(changes[i] for i in plan)
    return VerifiedPlan(tuple(plan), predicted, verified, agreement, additive, tuple(steps))


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
