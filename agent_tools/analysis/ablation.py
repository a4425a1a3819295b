"""Ablation effects as pure tensor functions: replacing head slices, masked means, cosine change, effect size.

The KL of next-token distributions (was ``next_token_kl``) and the next-token loss (was ``token_losses``) are
:mod:`agent_tools.analysis.metrics`' ``kl_divergence`` and ``next_token_losses``.

Shapes: ``B`` batch, ``T`` positions, ``V`` vocabulary, ``C`` hidden size, ``H`` heads, ``D`` head_dim.
Nothing here modifies its inputs.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from agent_tools.analysis.metrics import BASELINE_SIGMAS, Baseline, kl_divergence


def replace_head_slices(hidden: Tensor, heads: Sequence[int], head_dim: int, means: Tensor | None = None) -> Tensor:
    """(..., H·D) concatenated head outputs -> a copy with the named heads' slices zeroed or set to their mean.

    Args:
        hidden: the input of the output projection; head ``h`` owns features ``h·D .. (h+1)·D − 1``.
        heads: query heads to ablate.
        head_dim: ``D``.
        means: (H, D) per-head mean output to substitute (mean ablation), or (T, H, D) another run's outputs
            position by position (resample ablation); ``None`` zeroes (zero ablation).
    """
    shape = hidden.shape
    num_heads = shape[-1] // head_dim
    per_head = hidden.reshape(*shape[:-1], num_heads, head_dim).clone()  # (..., H, D)
    index = torch.tensor(list(heads), dtype=torch.long, device=hidden.device)
    if means is None:
        per_head[..., index, :] = 0
    else:
        chosen = means[index] if means.dim() == 2 else means[:, index]  # (k, D) or (T, k, D)
        per_head[..., index, :] = chosen.to(hidden.dtype)
    return per_head.reshape(shape)  # (..., H·D)


def masked_mean(hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """(B, T, F), mask (B, T) -> (F,): the mean over every unmasked position of every sequence."""
    flat = hidden.double()
    if attention_mask is None:
        return flat.mean(dim=(0, 1)).to(hidden.dtype)
    weights = attention_mask.to(flat.dtype)[..., None]  # (B, T, 1)
    return ((flat * weights).sum(dim=(0, 1)) / weights.sum().clamp_min(1)).to(hidden.dtype)


def cosine_change(a: Tensor, b: Tensor) -> Tensor:
    """(…, C) pairs -> (…,): 1 − cos(a, b); 0 = same direction, 1 = orthogonal, 2 = opposite."""
    return 1 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def effect_size(clean: Tensor, ablated: Tensor, *, language_model: bool) -> float:
    """How much an ablation changed the output, as one number.

    Causal LM: KL(clean ‖ ablated) of the next-token distribution, averaged over positions (nats);
    encoder: 1 − cos of the position-averaged last hidden states.
    """
    if language_model:
        return float(kl_divergence(clean, ablated).mean())
    return float(cosine_change(clean.mean(1), ablated.mean(1)).mean())


# --- sizing an effect against a baseline of random heads ---------------------------------------------------------

BASELINE_DRAWS = 8  # random head sets drawn for a baseline unless the caller asks for another number
# an effect is beyond chance when it is more than BASELINE_SIGMAS (2) standard deviations from the baseline's mean and
EFFECT_FLOOR = 1e-3  # more than this (nats) from it and from 0 (float noise, sd ≈ 0)
TIE_MARGIN = 0.02  # two tokens whose probabilities differ by less than this are a tie, not a ranking

Direction = Literal["raises", "lowers", "within"]


def compare_with_baseline(effect: float, baseline: Baseline) -> Direction:
    """Where a signed effect (e.g. the loss change when heads are removed) falls against random heads' effects.

    ``raises``: above the baseline's mean by more than max(2·spread, floor) and above +floor; ``lowers``: below the
    mean by more than that and below −floor; ``within`` otherwise (also with no draws: no comparison).
    """
    if baseline.draws == 0:
        return "within"
    side = baseline.side(effect, sds=BASELINE_SIGMAS, floor=EFFECT_FLOOR)
    if side == 1 and effect > EFFECT_FLOOR:
        return "raises"
    if side == -1 and effect < -EFFECT_FLOOR:
        return "lowers"
    return "within"


def size_against(effect: float, baseline: Baseline) -> Literal["larger", "smaller", "within"]:
    """An unsigned effect (a KL) against random heads': beyond max(2·spread, floor) above or below the mean."""
    if baseline.draws == 0:
        return "within"
    sizes: dict[int, Literal["larger", "smaller", "within"]] = {1: "larger", -1: "smaller", 0: "within"}
    return sizes[baseline.side(effect, sds=BASELINE_SIGMAS, floor=EFFECT_FLOOR)]


def draw_head_sets(
    pool: Sequence[tuple[int, int]], count: int, draws: int, *, seed: int = 0
) -> list[tuple[tuple[int, int], ...]]:
    """``draws`` distinct random sets of ``count`` heads from ``pool`` (each set sorted), seeded.

    When the pool holds fewer distinct sets than ``draws`` every set is returned (in order); when it holds fewer
    than ``count`` heads, none (the caller says why there is no baseline).
    """
    heads = sorted(set(pool))
    if count <= 0 or len(heads) < count:
        return []
    if math.comb(len(heads), count) <= draws:
        return [tuple(c) for c in itertools.combinations(heads, count)]
    rng = random.Random(seed)
    chosen: list[tuple[tuple[int, int], ...]] = []
    seen: set[tuple[tuple[int, int], ...]] = set()
    while len(chosen) < draws:
        drawn = tuple(sorted(rng.sample(heads, count)))
        if drawn not in seen:
            seen.add(drawn)
            chosen.append(drawn)
    return chosen


def derangement(length: int, fixed: Sequence[int], *, seed: int = 0) -> list[int] | None:
    """A seeded permutation of positions ``0..length-1`` that keeps ``fixed`` in place and moves every other one
    (None when fewer than two positions may move: no such permutation)."""
    free = [p for p in range(length) if p not in set(fixed)]
    if len(free) < 2:
        return None
    rng = random.Random(seed)
    while True:
        shuffled = free[:]
        rng.shuffle(shuffled)
        if all(a != b for a, b in zip(free, shuffled, strict=True)):
            break
    order = list(range(length))
    for source, target in zip(free, shuffled, strict=True):
        order[source] = target
    return order
