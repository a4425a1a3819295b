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

Shapes: ``h`` heads kept, ``q`` query rows, ``k`` keys.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from agent_tools.analysis.maps import attention_entropy
from agent_tools.analysis.norms import (
    head_output_grams,
    head_output_norms,
    output_projection,
    projected_output_norms,
    transformed_value_norms,
    value_share_sums,
)
from agent_tools.capture import LayerAttention
from agent_tools.families import find_attention_modules

RowTarget = Literal["sink", "self", "previous_token", "other"]
ROW_TARGETS: tuple[str, ...] = get_args(RowTarget)
Concentration = Literal["sink", "self", "previous_token", "fixed_token", "mixed"]
CONCENTRATIONS: tuple[str, ...] = get_args(Concentration)
Verdict = Literal["no_op_sink", "harmful_collapse", "positional", "query_dependent", "not_collapsed"]
VERDICTS: tuple[str, ...] = get_args(Verdict)

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
    read) without recomputing them; two passes and one temporary.
    """
    count = allowed.sum(-1, keepdim=True, dtype=logits.dtype).clamp_min(1)  # before broadcasting: cheap
    z = torch.where(allowed, logits, 0.0)  # (..., q, k)
    z.sub_(z.sum(-1, keepdim=True) / count).masked_fill_(~allowed, 0.0)
    return torch.linalg.vector_norm(z, dim=-1)


def zhai_entropy_bound(radius: Tensor, count: Tensor) -> Tensor:
    """Lower bound on softmax entropy (nats) for ``count`` logits whose centred norm is ``radius`` (Zhai et al.).

    Tight: attained by one logit ``r·sqrt((T−1)/T)`` above the mean and the rest equal. ``count ≤ 1`` gives 0.
    """
    r = radius.double()
    t = count.double()
    several = t > 1
    t_safe = torch.where(several, t, torch.full_like(t, 2.0))
    eta = torch.exp(-r * torch.sqrt(t_safe / (t_safe - 1)))
    rest = (t_safe - 1) * eta
    bound = torch.log1p(rest) + r * torch.sqrt(t_safe * (t_safe - 1)) * eta / (1 + rest)
    return torch.where(several, bound, torch.zeros_like(bound))


def entropy_lower_bound(scores: Tensor, allowed: Tensor) -> Tensor:
    """(..., q, k) pre-mask scores -> (..., q): the Zhai et al. bound for each row over its visible keys."""
    count = allowed.expand(scores.shape).sum(-1)
    return zhai_entropy_bound(centred_score_norm(scores, allowed), count)


def row_targets(argmax: Tensor, query_positions: Tensor, sink_mask: Tensor) -> Tensor:
    """Where each row's argmax goes, as indices into :data:`ROW_TARGETS` (sink before self before previous).

    Args:
        argmax: (..., q) key index of each row's largest weight.
        query_positions: (q,) key column of each query (its own position).
        sink_mask: (k,) bool, True for the first token and special tokens.
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
    """Harmful collapse vs harmless sink: a concentrated head is judged by what its dominant key writes.

    ``contribution_ratio`` = mean_i ‖α_ij* v_j* W_O‖ / mean_k≠j* ‖v_k W_O‖ (None without the value side: a
    concentrated head onto one key is then reported as a collapse, the cautious reading).
    """
    if not concentrated:
        return "not_collapsed"
    if concentration in ("self", "previous_token"):
        return "positional"
    if concentration == "mixed":
        return "query_dependent"
    if contribution_ratio is not None and contribution_ratio < NO_OP_CONTRIBUTION:
        return "no_op_sink"
    return "harmful_collapse"


class HeadAccumulator:
    """Running sums for ``h`` heads of one layer over query chunks; :meth:`finish` gives :class:`HeadCollapse`."""

    def __init__(self, layer: int, heads: Sequence[int], keys: int, *, threshold: float) -> None:
        n = len(heads)
        self.layer, self.heads, self.threshold = layer, list(heads), threshold
        self.rows = 0
        self.entropy = torch.zeros(n, dtype=torch.float64)
        self.normalised = torch.zeros(n, dtype=torch.float64)
        self.max_weight = torch.zeros(n, dtype=torch.float64)
        self.saturated = torch.zeros(n, dtype=torch.float64)
        self.column = torch.zeros(n, keys, dtype=torch.float64)  # Σ rows of weight per key
        self.argmax = torch.zeros(n, keys, dtype=torch.float64)  # rows whose argmax is the key
        self.targets = torch.zeros(n, len(ROW_TARGETS), dtype=torch.float64)
        self.radius = torch.zeros(n, dtype=torch.float64)
        self.bound = torch.zeros(n, dtype=torch.float64)
        self.slack = torch.full((n,), math.inf, dtype=torch.float64)
        self.violations = torch.zeros(n, dtype=torch.long)
        self.value_norms: Tensor | None = None  # (h, k) ‖v_j W_O^h‖
        self.value_share: Tensor | None = None  # (h, k) Σ rows of each key's share of Σ‖α v W_O‖
        self.output_norm: Tensor | None = None  # (h,) Σ rows of ‖head output‖

    def add(
        self,
        weights: Tensor,
        scores: Tensor | None,
        allowed: Tensor,
        query_positions: Tensor,
        sink_mask: Tensor,
        *,
        value_norms: Tensor | None = None,
        output_norms: Tensor | None = None,
        entropy: Tensor | None = None,
        peak: tuple[Tensor, Tensor] | None = None,
        radius: Tensor | None = None,
    ) -> None:
        """Add rows: weights/scores (h, q, k) over key columns [0, k), allowed (q, k), positions (q,),
        sink_mask (keys,), value_norms (h, keys) ‖v_j W_O^h‖, output_norms (h, q) ‖Σ_j α_ij v_j W_O^h‖.

        ``entropy`` (h, q), ``peak`` ((h, q) max, (h, q) argmax) and ``radius`` (h, q) centred score norm may be
        given when the caller already has them (the capture computes them once for every consumer); ``scores``
        is then not read.
        """
        width = weights.shape[-1]
        visible = allowed.sum(-1)  # (q,)
        keep = visible > 1  # rows that can choose between keys
        if not bool(keep.any()):
            return
        if entropy is None:
            entropy = attention_entropy(weights if weights.dtype == torch.float64 else weights.float())
        top, argmax = peak if peak is not None else weights.max(-1)  # (h, q)
        if radius is None:
            assert scores is not None, "scores are needed when the centred score norm is not given"
            radius = centred_score_norm(scores, allowed)
        if not bool(keep.all()):  # only the first rows of a causal map see a single key
            weights, allowed, visible = weights[:, keep], allowed[keep], visible[keep]
            query_positions = query_positions[keep]
            entropy, top, argmax, radius = entropy[:, keep], top[:, keep], argmax[:, keep], radius[:, keep]
            output_norms = output_norms[:, keep] if output_norms is not None else None
        entropy, top, radius = entropy.double(), top.double(), radius.double()
        self.rows += int(keep.sum())
        self.entropy += entropy.sum(-1)
        self.normalised += (entropy / visible.double().log()).sum(-1)
        self.max_weight += top.sum(-1)
        self.saturated += (top >= self.threshold).double().sum(-1)
        self.column[:, :width] += weights.sum(1).double()
        self.argmax.scatter_add_(1, argmax, torch.ones_like(top))
        codes = row_targets(argmax, query_positions, sink_mask)  # (h, q)
        self.targets.scatter_add_(1, codes, torch.ones_like(top))
        bound = zhai_entropy_bound(radius, visible.expand_as(radius))
        slack = entropy - bound
        self.radius += radius.sum(-1)
        self.bound += bound.sum(-1)
        self.slack = torch.minimum(self.slack, slack.min(-1).values)
        self.violations += (slack < -1e-5).sum(-1)
        if value_norms is not None:
            if self.value_norms is None or self.value_share is None:
                self.value_norms = value_norms.double().clone()
                self.value_share = torch.zeros_like(self.column)
            self.value_share[:, :width] += value_share_sums(weights, value_norms[:, :width]).double()
        if output_norms is not None:
            sums = output_norms.double().sum(-1)
            self.output_norm = sums if self.output_norm is None else self.output_norm + sums

    def finish(self, sink_mask: Tensor) -> list[HeadCollapse]:
        if self.rows == 0:
            return []
        n = float(self.rows)
        results = []
        for i, head in enumerate(self.heads):
            column = self.column[i] / n
            dominant = int(column.argmax())
            targets = self.targets[i] / n
            counts = self.argmax[i].masked_fill(sink_mask, -1.0)
            top_other = int(counts.argmax()) if bool((counts > 0).any()) else None
            top_other_fraction = float(counts[top_other] / n) if top_other is not None else 0.0
            mean_max = float(self.max_weight[i] / n)
            saturated = float(self.saturated[i] / n)
            concentrated = mean_max >= CONCENTRATED_MEAN_MAX or saturated >= CONCENTRATED_SATURATED
            concentration = classify_concentration(
                float(targets[ROW_TARGETS.index("sink")]),
                float(targets[ROW_TARGETS.index("self")]),
                float(targets[ROW_TARGETS.index("previous_token")]),
                top_other_fraction,
            )
            dominant_norm = other_norm = ratio = value_share = contribution = contribution_ratio = output = None
            if self.value_norms is not None and self.value_share is not None:
                norms = self.value_norms[i]
                dominant_norm = float(norms[dominant])
                others = torch.cat([norms[:dominant], norms[dominant + 1 :]])
                other_norm = float(others.mean()) if others.numel() else 0.0
                ratio = dominant_norm / other_norm if other_norm > 0 else math.inf
                value_share = float(self.value_share[i, dominant] / n)
                contribution = float(column[dominant]) * dominant_norm  # mean_i α_ij* ‖v_j* W_O‖
                contribution_ratio = contribution / other_norm if other_norm > 0 else math.inf
            if self.output_norm is not None:
                output = float(self.output_norm[i] / n)
            results.append(
                HeadCollapse(
                    layer=self.layer,
                    head=head,
                    rows=self.rows,
                    mean_entropy=float(self.entropy[i] / n),
                    mean_normalised_entropy=float(self.normalised[i] / n),
                    mean_max_weight=mean_max,
                    saturated_fraction=saturated,
                    dominant_position=dominant,
                    dominant_share=float(column[dominant]),
                    dominant_argmax_fraction=float(self.argmax[i, dominant] / n),
                    sink_fraction=float(targets[ROW_TARGETS.index("sink")]),
                    self_fraction=float(targets[ROW_TARGETS.index("self")]),
                    previous_fraction=float(targets[ROW_TARGETS.index("previous_token")]),
                    top_other_position=top_other,
                    top_other_fraction=top_other_fraction,
                    concentration=concentration,
                    concentrated=concentrated,
                    dominant_value_norm=dominant_norm,
                    other_value_norm=other_norm,
                    value_norm_ratio=ratio,
                    dominant_value_share=value_share,
                    dominant_contribution=contribution,
                    contribution_ratio=contribution_ratio,
                    mean_output_norm=output,
                    mean_centred_score_norm=float(self.radius[i] / n),
                    mean_entropy_bound=float(self.bound[i] / n),
                    min_bound_slack=float(self.slack[i]),
                    bound_violations=int(self.violations[i]),
                    verdict=collapse_verdict(concentration, concentrated, contribution_ratio),
                )
            )
        return results


def collapse_statistics(
    weights: Tensor,
    scores: Tensor,
    allowed: Tensor,
    sink_mask: Tensor,
    *,
    layer: int = 0,
    heads: Sequence[int] | None = None,
    threshold: float = 0.99,
    value_norms: Tensor | None = None,
    output_norms: Tensor | None = None,
) -> list[HeadCollapse]:
    """Whole-map entry point: weights/scores (h, q, k) with query i at key column i, allowed (q, k)."""
    heads = list(range(weights.shape[0])) if heads is None else list(heads)
    accumulator = HeadAccumulator(layer, heads, weights.shape[-1], threshold=threshold)
    positions = torch.arange(weights.shape[-1] - weights.shape[-2], weights.shape[-1])
    accumulator.add(weights, scores, allowed, positions, sink_mask, value_norms=value_norms, output_norms=output_norms)
    return accumulator.finish(sink_mask)


# --- streaming over a forward pass ------------------------------------------------------------------------


class CollapseConsumer:
    """Per layer and query chunk, turns the captured maps into running sums and drops them.

    Reads per-row tensors only up to ``key_width`` (later columns carry no weight), so causal chunks are
    computed over their visible keys only.

    Holds O(layers · heads · keys) numbers, never a map. With ``output_grams`` (per layer, (H, D, D)) it
    also measures the value side from the captured values: ‖v_j W_O^h‖ per key and ‖head output‖ per row.
    """

    accepts_key_prefix = True

    def __init__(
        self,
        sink_mask: Tensor,
        *,
        heads: Sequence[int] | None = None,
        threshold: float = 0.99,
        output_grams: dict[int, Tensor] | None = None,
        batch_index: int = 0,
    ) -> None:
        self.sink_mask = sink_mask
        self.heads = list(heads) if heads is not None else None
        self.threshold = threshold
        self.output_grams = output_grams or {}
        self.batch_index = batch_index
        self.layers: dict[int, HeadAccumulator] = {}

    def on_layer(self, captured: LayerAttention) -> None:
        b = self.batch_index
        heads = self.heads if self.heads is not None else list(range(captured.weights.shape[1]))
        accumulator = self.layers.get(captured.layer)
        if accumulator is None:
            accumulator = HeadAccumulator(captured.layer, heads, captured.key_length, threshold=self.threshold)
            self.layers[captured.layer] = accumulator
        every_head = heads == list(range(captured.weights.shape[1]))
        index = torch.tensor(heads)

        def pick(tensor: Tensor) -> Tensor:  # (H, ...) -> (h, ...)
            return tensor if every_head else tensor.index_select(0, index)

        allowed = captured.allowed()[b, 0]  # (q, k)
        if captured.logits is not None:  # scores = logits where a key may be read: no second q·kᵀ
            radius = centred_logit_norm(pick(captured.logits[b]), allowed)  # (h, q)
        else:
            radius = centred_score_norm(pick(captured.scores[b]), allowed)
        top, argmax = captured.row_max()
        start = captured.key_index_offset
        positions = torch.arange(start, start + captured.weights.shape[2])
        value_norms = output_norms = None
        grams = self.output_grams.get(captured.layer)
        if grams is not None:
            if accumulator.value_norms is not None:  # keys are the same for every query chunk
                value_norms = accumulator.value_norms
            else:
                value = captured.value[b : b + 1]  # (1, Hkv, Tk, D)
                value_norms = pick(transformed_value_norms(value, grams, kv_groups=captured.kv_groups)[0])  # (h, Tk)
            if captured.output is not None:
                outputs = projected_output_norms(captured.output[b : b + 1], grams)  # (1, H, q)
            else:
                outputs = head_output_norms(
                    captured.weights[b : b + 1], captured.value[b : b + 1], grams, kv_groups=captured.kv_groups
                )
            output_norms = pick(outputs[0])
        accumulator.add(
            pick(captured.weights[b]),
            None,
            allowed,
            positions,
            self.sink_mask.to(captured.weights.device),
            value_norms=value_norms,
            output_norms=output_norms,
            entropy=pick(captured.row_entropy()[b]),
            peak=(pick(top[b]), pick(argmax[b])),
            radius=radius,
        )

    def results(self) -> list[HeadCollapse]:
        found: list[HeadCollapse] = []
        for layer in sorted(self.layers):
            found.extend(self.layers[layer].finish(self.sink_mask))
        return found


def output_grams_for(model: torch.nn.Module, layers: Sequence[int], num_heads: int) -> dict[int, Tensor]:
    """(H, D, D) Gram matrices of each requested layer's output projection, for :class:`CollapseConsumer`."""
    modules = find_attention_modules(model)
    return {layer: head_output_grams(output_projection(model, modules[layer]), num_heads) for layer in layers}


def rank_heads(heads: Sequence[HeadCollapse]) -> list[HeadCollapse]:
    """Most collapsed first."""
    return sorted(heads, key=lambda h: (-h.collapse_score, h.layer, h.head))
