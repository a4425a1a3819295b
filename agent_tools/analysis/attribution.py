"""Evidence beside attention, as pure functions: rank agreement, causal effects, patching, direct logit attribution.

Attention share says what a position *reads*; it does not say what the answer *depends on* (Jain & Wallace 2019;
Wiegreffe & Pinter 2019). The functions here turn what the runner measured (log-probabilities under ablations,
gradients, patched logit differences, per-head writes) into the numbers the reports compare:

* :func:`spearman` / :func:`rank_agreement` — do two measures order the segments alike?
* :func:`answer_logprobs` / :func:`logprob_changes` — teacher-forced answer log-probabilities and their change;
* :func:`restored_fraction` — the share of a logit difference a patch restores (activation patching);
* :func:`frozen_norm_map` — the final norm with its scale frozen at the clean run's value, through which each head
  writes into one logit (direct logit attribution);
* :func:`value_weighted_rows` / :func:`relative_value_norms` / :func:`filler_positions` — Kobayashi et al.'s
  ‖α·v·W_O‖ shares and the tokens that are read like sinks but write little (secondary sinks, filler).

Tensors in, tensors or floats out; inputs are never modified. Shapes: ``S`` segments, ``T`` positions, ``L``
layers, ``H`` heads, ``A`` answer tokens, ``V`` vocabulary, ``C`` model width.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from agent_tools.analysis.norms import norm_shares

LOW_VALUE_NORM = 0.9  # a token writes "little" when its ‖v W_O‖ is at most this fraction of the text's median
SINK_LIKE_RATIO = 2.0  # ... and it is read "like a sink" when it receives ≥ 2× what uniform attention would give
MIN_READERS = 4  # ... by at least this many later queries (as threshold_sinks requires)


# --- ranks -------------------------------------------------------------------------------------------------------
def average_ranks(values: Sequence[float]) -> list[float]:
    """Ranks 1..n of ``values`` (1 = largest), ties sharing the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: -values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's ρ: the Pearson correlation of the average ranks; None when n < 2 or a measure is constant.

    ρ = 1: both measures order the items the same way; −1: opposite; 0: unrelated orders.
    """
    if len(a) != len(b):
        raise ValueError(f"spearman needs two equally long lists, got {len(a)} and {len(b)}")
    if len(a) < 2:
        return None
    ra, rb = average_ranks(a), average_ranks(b)
    mean = (len(a) + 1) / 2
    da, db = [r - mean for r in ra], [r - mean for r in rb]
    norm = math.sqrt(sum(x * x for x in da) * sum(y * y for y in db))
    if norm == 0:
        return None
    return sum(x * y for x, y in zip(da, db, strict=True)) / norm


def top_index(values: Sequence[float]) -> int:
    """The index of the largest value (the first on ties)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def rank_agreement(measures: Mapping[str, Sequence[float]]) -> list[tuple[str, str, float | None, bool]]:
    """Every pair of measures (in the given order) -> (a, b, Spearman ρ, whether they put the same item first)."""
    names = list(measures)
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            same_top = top_index(measures[a]) == top_index(measures[b])
            rows.append((a, b, spearman(measures[a], measures[b]), same_top))
    return rows


# --- causal effects -----------------------------------------------------------------------------------------------
def answer_logprobs(logits: Tensor, answer_ids: Tensor) -> Tensor:
    """(R, A, V) logits at the positions that predict each answer token, (A,) ids -> (R, A) log-probabilities."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)  # (R, A, V)
    index = answer_ids.to(logits.device).view(1, -1, 1).expand(logits.shape[0], -1, 1)
    return logprobs.gather(-1, index)[..., 0]  # (R, A)


def logprob_changes(ablated: Tensor, clean: Tensor) -> tuple[Tensor, Tensor]:
    """(R, A) ablated and (A,) clean log-probabilities -> (R,) change of the first token's, (R,) of the sum's.

    Negative: the ablation made the answer less likely (the answer depends on what was ablated).
    """
    first = ablated[:, 0] - clean[0]
    whole = ablated.sum(-1) - clean.sum()
    return first, whole


def restored_fraction(patched: Tensor, clean: float, corrupted: float) -> Tensor:
    """(…,) patched logit differences -> (patched − corrupted) / (clean − corrupted).

    1: the patch restores the clean run's logit difference; 0: nothing of it. The caller refuses a pair whose
    clean and corrupted differences are (nearly) equal.
    """
    return (patched.double() - corrupted) / (clean - corrupted)


# --- direct logit attribution ---------------------------------------------------------------------------------------
def norm_scale(x: Tensor, *, centred: bool, eps: float) -> Tensor:
    """(…, C) -> (…,): the scale σ a LayerNorm (``centred``) or RMSNorm divides by: sqrt(mean(P(x)²) + eps)."""
    z = x.double()
    if centred:
        z = z - z.mean(-1, keepdim=True)
    return (z.pow(2).mean(-1) + eps).sqrt()


def frozen_norm_map(
    outputs: Tensor, inputs: Tensor, bias: Tensor, *, centred: bool, eps: float, scale: Tensor
) -> Tensor:
    """The final norm with its scale frozen, applied to vectors it has already been run on.

    A norm computes ``f(v) = g ⊙ P(v) / σ(v) + β`` (``P`` centres for a LayerNorm; ``g`` is ``γ`` or Gemma's
    ``1 + γ``). With σ frozen at the clean residual's ``scale`` it is linear: ``F(v) = g ⊙ P(v) / scale``. From the
    module's own outputs ``f(v)`` on ``v`` (so no weight is read) ``F(v) = (f(v) − β) · σ(v) / scale``.

    Args:
        outputs: (K, C) the norm's outputs on ``inputs``.
        inputs: (K, C) what it was run on.
        bias: (C,) its output on the zero vector, ``β`` (0 for an RMSNorm).
        centred, eps: its form (LayerNorm or RMSNorm) and epsilon.
        scale: () σ of the clean residual the answer was read from.
    """
    sigma = norm_scale(inputs, centred=centred, eps=eps)  # (K,)
    return (outputs.double() - bias.double()) * (sigma / scale.double())[:, None]


# --- value-weighted shares and filler --------------------------------------------------------------------------------
def value_weighted_rows(weights: Tensor, value_norms: Tensor) -> Tensor:
    """(…, Tk) attention rows, (…, Tk) ‖v_j W_O^h‖ -> (…, Tk) each key's share of Σ_j ‖α_j v_j W_O^h‖.

    Kobayashi et al. (2020): a key that receives weight but writes a small vector contributes little; rows whose
    total is zero give zeros (:func:`agent_tools.analysis.norms.norm_shares` of the weighted norms).
    """
    return norm_shares(weights.float() * value_norms.float())


def relative_value_norms(norms: Tensor, reference: Tensor) -> Tensor:
    """(L, T) per-layer mean ‖v_j W_O‖ over heads, (T,) bool tokens to take the median over -> (T,) mean over
    layers of each token's norm divided by that layer's median: 1 = a typical token of this text, 0.5 = half."""
    if not bool(reference.any()):
        reference = torch.ones_like(reference)
    medians = norms[:, reference].median(dim=-1).values.clamp_min(1e-30)  # (L,)
    return (norms / medians[:, None]).mean(0)


def filler_positions(received_ratio: Tensor, readers: Tensor, relative_norms: Tensor, candidates: Tensor) -> list[int]:
    """Secondary sinks and filler: tokens read like a sink by many queries whose values write little.

    A candidate token ``j`` qualifies when at least :data:`MIN_READERS` later queries could read it, it receives at
    least :data:`SINK_LIKE_RATIO` × what uniform attention would give it (mean over those queries, layers and heads)
    and its relative value norm (see :func:`relative_value_norms`) is at most :data:`LOW_VALUE_NORM`.

    Args:
        received_ratio: (T,) mean received share / uniform share.
        readers: (T,) how many later queries could read each token.
        relative_norms: (T,) ‖v_j W_O‖ relative to the text's median token.
        candidates: (T,) bool: tokens that may qualify (not the sink, inside the prompt's content).
    """
    heavy = candidates & (readers >= MIN_READERS) & (received_ratio >= SINK_LIKE_RATIO)
    heavy &= relative_norms <= LOW_VALUE_NORM
    return [int(p) for p in torch.nonzero(heavy).flatten().tolist()]


def content_shares(token_weights: Tensor, segment_index: Tensor, num_segments: int, excluded: Tensor) -> Tensor:
    """(T,) attention per token, (T,) segments, (T,) bool excluded (sink, filler) -> (S,) shares renormalised
    over the tokens that are not excluded: what each segment's content takes of the attention left."""
    kept = torch.where(excluded, torch.zeros_like(token_weights), token_weights.float())
    shares = kept.new_zeros(num_segments).index_add(0, segment_index, kept)
    return shares / shares.sum().clamp_min(1e-12)


def segment_sums(values: Tensor, segment_index: Tensor, num_segments: int) -> Tensor:
    """(T,) per-token values (gradients, attributions) -> (S,) summed per segment."""
    return values.new_zeros(num_segments).index_add(0, segment_index.to(values.device), values)


def deciding_step(deltas: Tensor) -> int:
    """(S, A) Δ log p of each answer token when each segment is removed -> the step whose |Δ| is largest over the
    segments: the answer token the segments move most (the first on ties)."""
    if deltas.numel() == 0:
        raise ValueError("deciding_step needs at least one segment and one answer token")
    moved = deltas.abs().amax(0)  # (A,)
    return int(torch.nonzero(moved == moved.max()).flatten()[0])
