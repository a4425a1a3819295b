"""The metrics glossary: every attention metric the tools report, defined once, with its formula.

``A`` is one head's map (rows = queries ``i``, columns = keys ``j``, rows sum to 1), ``n_i`` the number of keys
row ``i`` may read (``i + 1`` in a causal map), ``allowed`` a bool tensor marking those keys (True = may read).
Logs are natural: entropies and divergences are in nats.

::

    name                                    formula                                                          range
    --------------------------------------  ---------------------------------------------------------------  ----------
    attention_entropy                       H_i = −Σ_j A_ij ln A_ij (0 ln 0 = 0), nats                       [0, ln n_i]
                                            used by: every per-head statistic (grid, show_attention, collapse, …)
    visible_keys                            n_i = Σ_j allowed_ij                                             0, 1, …
                                            used by: normalised_entropy, diagnose_collapse, the grid
    normalised_entropy                      H_i / ln n_i, 0 when n_i ≤ 1                                     [0, 1]
                                            used by: show_attention, inspect_projections, reconstruct_attention
    normalised_from_entropy                 the same from an entropy already computed                        [0, 1]
                                            used by: grid, diagnose_collapse, explain_scaling, profile_heads' broad
    max_weight                              max_j A_ij and its key                                           [1/n_i, 1]
                                            used by: grid's max weight (capture's row_peak), diagnose_collapse
    saturated                               max_j A_ij ≥ threshold (SATURATION = 0.99 unless given)          bool
                                            used by: diagnose_collapse, explain_scaling, scaling_experiment
    masked_softmax                          softmax(z) over the allowed keys, exactly 0 elsewhere            [0, 1]
                                            used by: explain_scaling, reconstruct_attention, inspect_projections
    allowed_from_additive_mask              mask > dtype-min / 2 (additive mask -> bool allowed)             bool
                                            used by: reconstruct_attention, inspect_projections
    kl_divergence                           KL(P‖Q) = Σ_v P_v (ln P_v − ln Q_v), P, Q = softmax(logits)      [0, ∞)
                                            used by: ablate_heads, profile_heads' evidence, compare_prompts
    js_divergence                           ½ KL(P‖M) + ½ KL(Q‖M), M = ½ (P + Q)                             [0, ln 2]
                                            used by: reconstruct_attention, inspect_projections
    next_token_losses                       −ln softmax(logits_{t−1})[x_t], nats                             [0, ∞)
                                            used by: ablate_heads, profile_heads' induction probe
    first_token_share                       mean_i A_i0 over every row, row 0 included                       [0, 1]
                                            used by: the analyze grid's 'sink share'
    sink_row_fraction                       mean_i [argmax_j A_ij is a sink key] over rows with n_i ≥ 2      [0, 1]
                                            used by: diagnose_collapse's sink_fraction
    sink_key_mask                           key 0 or a special token                                         bool
                                            used by: diagnose_collapse's sink keys
    received_attention                      per key j: Σ A_ij over heads and rows i ≠ j that may read j      ≥ 0
                                            used by: trace_prompt_attention, compare_prompts
    threshold_sinks                         keys with mean received share ≥ threshold and ≥ ratio · uniform  positions
                                            used by: trace_prompt_attention's sink segment
    sink column share                       a learned sink column's softmax weight = 1 − Σ_j A_ij (GPT-OSS)  [0, 1]
                                            measured where the model's softmax runs (capture's
                                            LayerAttention.sink_share; analysis/reconstruct.sink_softmax)
                                            used by: reconstruct_attention's head_sinks
    without_sink                            s_k / Σ_{m ≠ sink} s_m, the sink segment 0                       [0, 1]
                                            used by: trace_prompt_attention's shares without the sink
    head role / pattern score               mean_i Σ_j A_ij P_ij over rows i ≥ skip that may read a key of P  [0, 1]
                                            (P: the role's kernel; one definition per role in the registry
                                            analysis/heads.ROLES, scored by consumers/roles.ShareAccumulator;
                                            the first_token role: mean_i A_i0 over rows i ≥ max(1, skip))
                                            used by: profile_heads' roles and named patterns, pattern_scores
    Baseline                                mean and sample std (n − 1) of an effect over random draws       ℝ
                                            used by: every random-heads baseline (profile_heads, ablate_heads,
                                            diagnose_collapse, patch_heads, find_circuit, find_retrieval_heads)
    chance_side                             +1 / −1 when effect ≷ mean ± max(k·std, floor), else 0            −1, 0, 1
                                            used by: every "beyond chance" verdict (ablation: k = 2, floor
                                            1e-3 nats; attribution patching: k = 3, floor 0.05 of the gap)
    exceeds_baseline                        chance_side(k = 2) = 1 over ≥ 2 random draws                     bool
                                            used by: profile_heads' "is a <role> head" verdicts

The "sink" numbers (``first_token_share``, the ``first_token`` role, ``sink_row_fraction``, ``threshold_sinks``, the
sink column share, ``without_sink``) are different measures and keep distinct names; each is defined once (the table
above says where, and each docstring says how it differs from the others).

Streaming consumers (:mod:`agent_tools.consumers`) add the same per-row terms chunk by chunk; the tests check
that their results equal these functions on whole maps. ``LayerAttention.row_entropy`` (capture) computes the
entropy from the softmax input in two passes instead (equal up to float32 rounding).

Everything here is pure: tensors in, tensors out, nothing modified. Shapes: ``...`` leading dims (batch,
heads), ``q`` query rows, ``k`` keys, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

# --- precision ------------------------------------------------------------------------------------------------


def upcast(tensor: Tensor) -> Tensor:
    """float16 / bfloat16 -> float32, for the reductions where precision matters (entropy, logs, variance,
    Jacobian); float32, float64 and integer tensors are returned as they are (the same tensor)."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


# --- entropy --------------------------------------------------------------------------------------------------


def attention_entropy(weights: Tensor) -> Tensor:
    """(..., q, k) probability rows -> (..., q): Shannon entropy ``H = −Σ_j p_j ln p_j`` in nats, 0·ln 0 = 0.

    Range [0, ln k]: 0 for a one-hot row, ln k for a uniform row over k keys. Half-precision rows are upcast to
    float32 first.
    """
    weights = upcast(weights)
    if weights.requires_grad:  # entr's gradient at p = 0 is −log 0: keep the where-form, whose gradient is 0 there
        logs = torch.where(weights > 0, weights.clamp_min(1e-30).log(), torch.zeros_like(weights))
        return (-(weights * logs).sum(-1)).clamp_min(0.0)
    return torch.special.entr(weights).sum(-1).clamp_min(0.0)  # entr(p) = −p log p, entr(0) = 0: one pass


def visible_keys(allowed: Tensor, shape: torch.Size | None = None) -> Tensor:
    """(..., q, k) bool -> (..., q): ``n_i = Σ_j allowed_ij``, how many keys each query may read.

    ``shape``: the weights' shape, to broadcast the count over heads after counting once.
    """
    count = allowed.sum(-1)  # before broadcasting: the heads share one mask
    return count.expand(shape[:-1]) if shape is not None else count


def normalised_from_entropy(entropy: Tensor, visible: Tensor) -> Tensor:
    """(..., q) entropy in nats, (..., q) visible keys -> (..., q): ``H_i / ln n_i``, 0 where ``n_i ≤ 1``.

    Range [0, 1]: 0 = all weight on one key, 1 = uniform over the visible keys. A row that sees one key cannot
    choose, so it gets 0 rather than 0/0. Integer counts are converted to the entropy's dtype; floating counts
    are used as given (the division then follows torch's type promotion).
    """
    count = visible if visible.is_floating_point() else visible.to(entropy.dtype)
    return torch.where(count > 1, entropy / count.clamp_min(2).log(), torch.zeros_like(entropy))


def normalised_entropy(weights: Tensor, allowed: Tensor | None = None, *, entropy: Tensor | None = None) -> Tensor:
    """(..., q, k) weights, bool ``allowed`` broadcastable to them -> (..., q): ``H_i / ln n_i`` in [0, 1].

    Without ``allowed`` every key counts as visible (``n_i = k``). Rows with one visible key give 0. ``entropy``:
    the rows' :func:`attention_entropy` when the caller has it already.
    """
    entropy = attention_entropy(weights) if entropy is None else entropy
    if allowed is None:
        count = torch.full_like(entropy, weights.shape[-1])
    else:
        count = visible_keys(allowed, weights.shape).to(entropy.dtype)
    return normalised_from_entropy(entropy, count)


# --- concentration ------------------------------------------------------------------------------------------


def max_weight(weights: Tensor) -> tuple[Tensor, Tensor]:
    """(..., q, k) -> ``max_j A_ij`` (..., q) in [1/n_i, 1] and the key that gets it (..., q)."""
    return weights.max(-1)


SATURATION = 0.99  # a row is saturated when its largest weight is at least this


def saturated(max_weights: Tensor, threshold: float = SATURATION) -> Tensor:
    """(...) each row's ``max_j A_ij`` -> (...) bool: ``max_j A_ij ≥ threshold``, the row is saturated."""
    return max_weights >= threshold


# --- softmax ------------------------------------------------------------------------------------------------


def masked_softmax(logits: Tensor, allowed: Tensor | None = None) -> Tensor:
    """(..., q, k) logits, bool ``allowed`` (True = may read) -> weights: ``softmax`` over the allowed keys.

    Hidden keys get exactly 0 (their logits become −inf); computed in the logits' dtype. A row with no allowed
    key is NaN. Callers holding an additive mask (0 / dtype-min) convert it with
    :func:`allowed_from_additive_mask`: the result is the same, since ``exp(z + min − max)`` is 0 too.
    """
    if allowed is not None:
        logits = logits.masked_fill(~allowed.expand(logits.shape), -math.inf)
    return torch.softmax(logits, dim=-1)


def allowed_from_additive_mask(mask: Tensor) -> Tensor:
    """Additive mask (0 where a key may be read, dtype-min or −inf where not) -> bool ``allowed``.

    The same threshold the capture uses: an entry below half the dtype's minimum hides the key.
    """
    return mask > torch.finfo(mask.dtype).min / 2


# --- divergences --------------------------------------------------------------------------------------------


def kl_divergence(logits_p: Tensor, logits_q: Tensor) -> Tensor:
    """(..., V) logits of P and Q -> (...,): ``KL(P ‖ Q) = Σ_v P_v (ln P_v − ln Q_v)`` in nats, ≥ 0.

    Direction: the expectation is under P (the first argument: the clean run, prompt A). Inputs are *logits*;
    both go through log-softmax in float64 (stable for tiny probabilities). Rounding below 0 is clamped to 0.
    """
    log_p = torch.log_softmax(logits_p.double(), dim=-1)
    log_q = torch.log_softmax(logits_q.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)


def _kl_sum(p: Tensor, q: Tensor) -> Tensor:
    """``Σ_j p_j (ln p_j − ln q_j)`` over terms with ``p_j > 0``, float64 inputs, not clamped."""
    terms = torch.where(p > 0, p * (p.clamp_min(1e-300).log() - q.clamp_min(1e-300).log()), torch.zeros_like(p))
    return terms.sum(-1)


def js_divergence(p: Tensor, q: Tensor) -> Tensor:
    """(..., k) x (..., k) probability rows -> (...,): ``JS = ½ KL(p ‖ m) + ½ KL(q ‖ m)``, ``m = ½ (p + q)``.

    Nats, symmetric, in [0, ln 2]: 0 for equal rows, ln 2 for rows with disjoint support. float64.
    """
    p64, q64 = p.double(), q.double()
    m = 0.5 * (p64 + q64)
    return (0.5 * _kl_sum(p64, m) + 0.5 * _kl_sum(q64, m)).clamp(0.0, math.log(2))


def next_token_losses(logits: Tensor, input_ids: Tensor, *, dtype: torch.dtype = torch.float64) -> Tensor:
    """(B, T, V) logits, (B, T) ids -> (B, T−1): ``−ln softmax(logits[t−1])[x_t]``, each next token's loss in nats.

    Entry ``t − 1`` is the cross-entropy of token ``t`` given the logits at the position before it (in ``dtype``:
    float64 by default; float32 where the logits stay on an accelerator).
    """
    log_probs = torch.log_softmax(logits[:, :-1].to(dtype), dim=-1)  # (B, T-1, V)
    return -log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


# --- sinks: four distinct measures -------------------------------------------------------------------------


def first_token_share(weights: Tensor) -> Tensor:
    """(..., q, k) -> (...): ``mean_i A_i0`` over *every* row, row 0 included (the ``analyze`` grid's sink share).

    Range [0, 1]. On a causal map row 0 can only read key 0 (``A_00 = 1``), so a T-row map never goes below 1/T.
    """
    return weights[..., 0].mean(-1)


def sink_key_mask(special: Sequence[bool] | Tensor) -> Tensor:
    """(k,) special-token flags -> (k,) bool: the sink keys — the first token plus every special token."""
    mask = torch.as_tensor(special, dtype=torch.bool).clone()
    if mask.numel():
        mask[0] = True
    return mask


def sink_row_fraction(weights: Tensor, sink_mask: Tensor, allowed: Tensor) -> Tensor:
    """(..., q, k) weights, (k,) sink keys, (q, k) bool allowed -> (...): share of rows whose argmax is a sink.

    ``mean_i [argmax_j A_ij ∈ sinks]`` over the rows that see at least two keys (``diagnose_collapse``'s
    ``sink_fraction``; :func:`sink_key_mask` gives its sinks: the first token and special tokens). Counts rows,
    not weight: a row with 0.3 on key 0 and 0.2 on each of three others counts fully. NaN without such rows.
    """
    choosing = visible_keys(allowed) > 1  # (q,)
    on_sink = sink_mask.to(weights.device)[weights.max(-1).indices]  # (..., q)
    return (on_sink & choosing).double().sum(-1) / choosing.double().sum()


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

    def mean_share(self) -> Tensor:
        """(Tk,) ``total / count``: the mean share a key receives from the (head, row) pairs that could read it."""
        return self.total / self.count.clamp_min(1)

    def to(self, device: torch.device | str) -> Received:
        """The same sums on ``device`` (four (Tk,) vectors)."""
        return Received(self.total.to(device), self.count.to(device), self.uniform.to(device), self.readers.to(device))

    def __add__(self, other: Received) -> Received:
        return Received(
            self.total + other.total,
            self.count + other.count,
            self.uniform + other.uniform,
            self.readers + other.readers,
        )


def received_attention(weights: Tensor, allowed: Tensor, query_positions: Tensor) -> Received:
    """One layer's rows -> per key ``Σ_{h, i ≠ j, allowed_ij} A^h_ij`` and the counts to average it.

    A query's weight on itself is excluded (every causal row can read itself).

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


def threshold_sinks(
    received: Received,
    *,
    threshold: float,
    min_readers: int = 4,
    min_ratio: float = 2.0,
    always: tuple[int, ...] = (0,),
) -> list[int]:
    """Sink positions: ``always`` (the first token) plus keys read heavily whatever the query.

    A key ``j`` is a sink when at least ``min_readers`` later queries could read it and its mean received share
    ``s_j = total_j / count_j`` (over those queries, all heads and layers) satisfies ``s_j ≥ threshold`` and
    ``s_j ≥ min_ratio · uniform_j / count_j`` — the second keeps short texts, where every share is large, from
    calling every token a sink.
    """
    mean, uniform = received.mean_share(), received.uniform / received.count.clamp_min(1)  # (T,) each
    heavy = (received.readers >= min_readers) & (mean >= threshold) & (mean >= min_ratio * uniform)
    found = {p for p in always if 0 <= p < mean.shape[0]}
    found |= {int(p) for p in torch.nonzero(heavy).flatten().tolist()}
    return sorted(found)


def without_sink(shares: Tensor, sink: int | None) -> Tensor:
    """(..., S) segment shares -> ``s_k / Σ_{m ≠ sink} s_m`` for ``k ≠ sink`` and 0 for the sink: the shares
    renormalised over every segment but the sink (``sink=None``: the shares as given). Range [0, 1]."""
    if sink is None:
        return shares
    kept = shares.clone()
    kept[..., sink] = 0
    return kept / kept.sum(-1, keepdim=True).clamp_min(1e-12)


# --- random-head baselines: is an effect larger than removing random heads? ----------------------------------


def chance_margin(spread: float, *, sds: float, floor: float) -> float:
    """How far from the random draws' mean an effect must fall to be beyond chance: ``max(sds·spread, floor)``."""
    return max(sds * spread, floor)


def chance_side(effect: float, mean: float, spread: float, *, sds: float, floor: float) -> Literal[1, 0, -1]:
    """Where an effect falls against random components' effects (mean ± standard deviation ``spread``):
    ``1`` when ``effect > mean + max(sds·spread, floor)``, ``-1`` when ``effect < mean − max(sds·spread, floor)``,
    ``0`` within (and for NaN). ``floor`` is the smallest distance that counts (draws that all give the same value
    leave no spread). The one "beyond chance" rule: each caller names its ``sds`` and ``floor``."""
    margin = chance_margin(spread, sds=sds, floor=floor)
    if effect > mean + margin:
        return 1
    if effect < mean - margin:
        return -1
    return 0


@dataclass(frozen=True)
class Baseline:
    """An effect measured on random components (heads or head sets), one value per draw: the draws' mean (NaN with
    none) and sample standard deviation (n − 1: with few draws the population std understates the spread; 0 with
    fewer than two draws). The one random baseline of every "beyond chance" verdict."""

    values: tuple[float, ...]

    @property
    def draws(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values) if self.values else math.nan

    @property
    def spread(self) -> float:
        """Sample standard deviation of the draws, ``sqrt(Σ (v − mean)² / (n − 1))`` (0 with fewer than two)."""
        n = len(self.values)
        if n < 2:
            return 0.0
        mean = self.mean
        return math.sqrt(sum((v - mean) ** 2 for v in self.values) / (n - 1))

    def side(self, effect: float, *, sds: float, floor: float) -> Literal[1, 0, -1]:
        """:func:`chance_side` against these draws (``0`` with none: the mean is NaN)."""
        return chance_side(effect, self.mean, self.spread, sds=sds, floor=floor)


BASELINE_SIGMAS = 2.0  # an effect counts when it is past the random draws' mean by two of their standard deviations


def exceeds_baseline(effect: float, baseline: Baseline, *, floor: float) -> bool:
    """:func:`chance_side` ``== 1`` with ``sds = 2``: the effect raises the measure (positive direction) by more
    than removing random components does. False with fewer than 2 draws: no baseline, no verdict."""
    if baseline.draws < 2:
        return False
    return baseline.side(effect, sds=BASELINE_SIGMAS, floor=floor) == 1
