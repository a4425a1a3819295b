"""Attention collapse: per-head concentration statistics, what the weight collapses onto, and whether it matters.

For each head we stream over query rows (never keeping a map) and accumulate:

* entropy of each row in nats, and normalised by ``log(visible keys)`` (a causal row ``i`` sees ``i + 1``);
* the row's max weight and whether it reaches a threshold (``saturated``);
* where the argmax goes: a *sink* (the first token or a special token such as [CLS]/[SEP]/BOS), the query
  itself, the previous token, or another key; and which key gets the most weight on average (*dominant*);
* the value side (Kobayashi et al. 2020): what the dominant key actually writes, ``mean_i ‖α_ij v_j W_O^h‖``,
  against the norm ``‖v_k W_O^h‖`` of the other keys (what reading an ordinary key would write), and its
  share of ``Σ_j ‖α_ij v_j W_O^h‖`` — a sink that takes the weight but writes almost nothing is a no-op;
* the entropy lower bound of Zhai et al. (2023) from the row's centred score norm
  ``r = ‖z − mean z‖₂`` over its visible keys: ``H(softmax z) ≥ log(1 + (T−1)η) + r·sqrt(T(T−1))·η / (1 + (T−1)η)``
  with ``η = exp(−r·sqrt(T/(T−1)))``. A row can only collapse when ``r`` is large.

Rows that see a single key (the first row of a causal model) are left out of every mean: they cannot choose.

Pure functions and the per-head summary only; the running sums over query chunks (``HeadAccumulator``) and the
capture consumer live in :mod:`agent_tools.consumers.collapse`. Entropy and
normalised entropy are :mod:`agent_tools.analysis.metrics`' ``attention_entropy`` / ``normalised_from_entropy``;
``sink_fraction`` is ``metrics.sink_row_fraction`` (rows whose argmax is a sink key), not a weight share.

Shapes: ``h`` heads kept, ``q`` query rows, ``k`` keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from agent_tools.analysis.ablation import Direction
from agent_tools.analysis.metrics import upcast

RowTarget = Literal["sink", "self", "previous_token", "other"]
ROW_TARGETS: tuple[str, ...] = get_args(RowTarget)
Concentration = Literal["sink", "self", "previous_token", "fixed_token", "mixed"]
Verdict = Literal["no_op_sink", "writing_collapse", "positional", "query_dependent", "not_collapsed"]
COLLAPSED_VERDICTS: tuple[Verdict, ...] = ("writing_collapse", "no_op_sink")  # concentrated onto one key
# What removing a collapsed head does, measured (see :func:`collapse_kind`)
CollapseKind = Literal["no_op_sink", "constant_output", "load_bearing", "harmful", "mixed"]
MAX_CHECKED_HEADS = 8  # collapsed heads whose removal is measured, most collapsed (writing collapses) first

CONCENTRATED_MEAN_MAX = 0.9  # a head whose rows put ≥ 90% on one key on average is concentrated ...
CONCENTRATED_SATURATED = 0.5  # ... as is one where half its rows reach the saturation threshold
PATTERN_MAJORITY = 0.5  # an argmax pattern names the head when it holds for at least half the rows
NO_OP_CONTRIBUTION = 0.5  # a dominant key writing < half of what an ordinary key would write is a no-op sink


# --- pure per-row measures ------------------------------------------------------------------------------


def centred_score_norm(scores: Tensor, allowed: Tensor) -> Tensor:
    """(..., q, k) pre-mask scores, bool visibility -> (..., q): ‖z − mean z‖₂ over each row's visible keys."""
    allowed = allowed.expand(scores.shape)
    z = scores if scores.dtype == torch.float64 else scores.float()
    z = z.masked_fill(~allowed, 0.0)
    count = allowed.sum(-1, keepdim=True).clamp_min(1)
    centred = (z - z.sum(-1, keepdim=True) / count).masked_fill(~allowed, 0.0)
    return centred.norm(dim=-1)


def centred_logit_norm(logits: Tensor, allowed: Tensor) -> Tensor:
    """(..., q, k) softmax input (scores + additive mask), bool visibility -> (..., q): ‖z − mean z‖₂ over
    each row's visible keys. Equals :func:`centred_score_norm` on the scores (the mask adds 0 where a key may be
    read) without recomputing them; two passes and one temporary. Half-precision logits are upcast to float32.
    """
    logits = upcast(logits)
    count = allowed.sum(-1, keepdim=True, dtype=logits.dtype).clamp_min(1)  # before broadcasting: cheap
    z = torch.where(allowed, logits, 0.0)  # (..., q, k)
    z.sub_(z.sum(-1, keepdim=True) / count).masked_fill_(~allowed, 0.0)
    return torch.linalg.vector_norm(z, dim=-1)


def zhai_entropy_bound(radius: Tensor, count: Tensor) -> Tensor:
    """Lower bound on softmax entropy (nats) for ``count`` logits whose centred norm is ``radius`` (Zhai et al.).

    Tight: attained by one logit ``r·sqrt((T−1)/T)`` above the mean and the rest equal. ``count ≤ 1`` gives 0.
    Computed in the radius' precision (float32 at least): float64 radii give float64 bounds.
    """
    dtype = torch.promote_types(radius.dtype, torch.float32)
    r = radius.to(dtype)
    t = count.to(dtype)
    several = t > 1
    t_safe = torch.where(several, t, torch.full_like(t, 2.0))
    eta = torch.exp(-r * torch.sqrt(t_safe / (t_safe - 1)))
    rest = (t_safe - 1) * eta
    bound = torch.log1p(rest) + r * torch.sqrt(t_safe * (t_safe - 1)) * eta / (1 + rest)
    return torch.where(several, bound, torch.zeros_like(bound))


def row_targets(argmax: Tensor, query_positions: Tensor, sink_mask: Tensor) -> Tensor:
    """Where each row's argmax goes, as indices into :data:`ROW_TARGETS` (sink before self before previous).

    Args:
        argmax: (..., q) key index of each row's largest weight.
        query_positions: (q,) key column of each query (its own position).
        sink_mask: (k,) bool, True for the first token and special tokens (on the device of ``argmax``).
    """
    sink = sink_mask[argmax]
    self_ = argmax == query_positions
    previous = argmax == query_positions - 1
    other = torch.full_like(argmax, ROW_TARGETS.index("other"))
    code = torch.where(previous, ROW_TARGETS.index("previous_token"), other)
    code = torch.where(self_, ROW_TARGETS.index("self"), code)
    return torch.where(sink, ROW_TARGETS.index("sink"), code)


# --- per-head summary -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadCollapse:
    """One head's concentration, what it concentrates on, and whether it matters (plain floats)."""

    layer: int
    head: int
    rows: int
    mean_entropy: float
    mean_normalised_entropy: float
    mean_max_weight: float
    saturated_fraction: float
    dominant_position: int
    dominant_share: float
    dominant_argmax_fraction: float
    sink_fraction: float
    self_fraction: float
    previous_fraction: float
    top_other_position: int | None
    top_other_fraction: float
    concentration: Concentration
    concentrated: bool
    dominant_value_norm: float | None
    other_value_norm: float | None
    value_norm_ratio: float | None
    dominant_value_share: float | None
    dominant_contribution: float | None
    contribution_ratio: float | None
    mean_output_norm: float | None
    mean_centred_score_norm: float
    mean_entropy_bound: float
    min_bound_slack: float
    bound_violations: int
    verdict: Verdict

    @property
    def collapse_score(self) -> float:
        """Ranking key: higher = more collapsed (mean max weight, then low normalised entropy)."""
        return self.mean_max_weight + 0.1 * (1.0 - self.mean_normalised_entropy)


def classify_concentration(
    sink: float, self_: float, previous: float, top_other: float, *, majority: float = PATTERN_MAJORITY
) -> Concentration:
    """Name the argmax pattern holding for the largest share of rows (at least ``majority``)."""
    options: dict[Concentration, float] = {
        "sink": sink,
        "self": self_,
        "previous_token": previous,
        "fixed_token": top_other,
    }
    kind, share = max(options.items(), key=lambda item: item[1])
    return kind if share >= majority else "mixed"


def collapse_verdict(concentration: Concentration, concentrated: bool, contribution_ratio: float | None) -> Verdict:
    """What a concentrated head's dominant key writes (value side only; whether it matters is :func:`collapse_kind`).

    ``contribution_ratio`` = mean_i ‖α_ij* v_j* W_O‖ / mean_k≠j* ‖v_k W_O‖: below :data:`NO_OP_CONTRIBUTION` a
    ``no_op_sink`` (writes almost nothing), else a ``writing_collapse`` (writes about the same, substantial, vector
    at every position). None without the value side: a concentrated head onto one key is then a writing collapse,
    the cautious reading.
    """
    if not concentrated:
        return "not_collapsed"
    if concentration in ("self", "previous_token"):
        return "positional"
    if concentration == "mixed":
        return "query_dependent"
    if contribution_ratio is not None and contribution_ratio < NO_OP_CONTRIBUTION:
        return "no_op_sink"
    return "writing_collapse"


def collapse_kind(
    verdict: Verdict, mean_ablation: Direction, resample_ablation: Direction | None = None
) -> CollapseKind:
    """A collapsed head named by what removing it did, each ablation already compared with random heads
    (:func:`agent_tools.analysis.ablation.compare_with_baseline`: ``raises`` / ``lowers`` the loss beyond the
    baseline's spread, or ``within`` it).

    * ``load_bearing``: an ablation raises the loss beyond chance (and none lowers it);
    * ``harmful``: an ablation lowers the loss beyond chance (the collapse makes predictions worse; none raises it);
    * ``mixed``: one raises, the other lowers;
    * else, nothing beyond chance: ``no_op_sink`` when the value side says it writes almost nothing, else
      ``constant_output`` (a large but input-independent write, a learned bias: replacing it by its mean changes
      nothing).
    """
    found = {mean_ablation, resample_ablation}
    if "raises" in found and "lowers" in found:
        return "mixed"
    if "raises" in found:
        return "load_bearing"
    if "lowers" in found:
        return "harmful"
    return "no_op_sink" if verdict == "no_op_sink" else "constant_output"


def rank_heads(heads: Sequence[HeadCollapse]) -> list[HeadCollapse]:
    """Most collapsed first."""
    return sorted(heads, key=lambda h: (-h.collapse_score, h.layer, h.head))
