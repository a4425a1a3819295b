"""Attention collapse, streamed: per-head running sums over query chunks, never a map.

:class:`HeadAccumulator` turns blocks of rows into the sums behind :class:`~agent_tools.analysis.collapse.HeadCollapse`
(the measures are defined in :mod:`agent_tools.analysis.collapse` and :mod:`agent_tools.analysis.metrics`);
:class:`CollapseConsumer` feeds it from the capture. Holds O(layers · heads · keys) numbers.

Each block of rows is reduced on its own device (the layer's); the sums live on the CPU, and a block hands them
two stacked tensors, (n, h) per-head and (m, h, keys) per-key sums (:mod:`agent_tools.consumers.host`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from torch import Tensor

from agent_tools.analysis.collapse import (
    CONCENTRATED_MEAN_MAX,
    CONCENTRATED_SATURATED,
    ROW_TARGETS,
    HeadCollapse,
    centred_logit_norm,
    centred_score_norm,
    classify_concentration,
    collapse_verdict,
    row_targets,
    zhai_entropy_bound,
)
from agent_tools.analysis.metrics import SATURATION, attention_entropy, normalised_from_entropy, saturated, upcast
from agent_tools.analysis.norms import (
    head_output_grams,
    head_output_norms,
    projected_output_norms,
    transformed_value_norms,
    value_share_sums,
)
from agent_tools.capture import LayerAttention
from agent_tools.consumers.host import PendingSums, accumulation_dtype
from agent_tools.layout import output_weight

BOUND_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# The per-head sums over the kept rows, rows of one (n, h) tensor: these, then one row per ROW_TARGETS entry (rows
# whose argmax goes there), then Σ ‖head output‖ when the value side is measured
ENTROPY, NORMALISED, MAX_WEIGHT, SATURATED, RADIUS, BOUND, VIOLATIONS, ROWS, TARGETS = range(9)
OUTPUT_NORM = TARGETS + len(ROW_TARGETS)


@dataclass(frozen=True)
class _ValueSide:
    """One head's value-side numbers (None without output Grams): see ``HeadCollapse``."""

    dominant_value_norm: float | None = None
    other_value_norm: float | None = None
    value_norm_ratio: float | None = None
    dominant_value_share: float | None = None
    dominant_contribution: float | None = None
    contribution_ratio: float | None = None


class HeadAccumulator:
    """Running sums for ``h`` heads of one layer over query chunks; :meth:`finish` gives :class:`HeadCollapse`.

    Each block of rows adds its sums on its own device (no host synchronisation per chunk); :meth:`flush` moves
    them to the CPU in one copy — the consumer calls it at a layer's last chunk, :meth:`finish` calls it too.
    """

    def __init__(self, layer: int, heads: Sequence[int], keys: int, *, threshold: float) -> None:
        self.layer, self.heads, self.threshold = layer, list(heads), threshold
        self.keys = keys
        # The sums live on the CPU (None until the first flush); each layer's blocks add theirs on the device
        self.per_head: Tensor | None = None  # (n, h): see ENTROPY .. OUTPUT_NORM
        # (2 or 3, h, keys): Σ rows of weight per key, rows whose argmax is the key, and with the value side Σ rows
        # of each key's share of Σ‖α v W_O‖
        self.per_key: Tensor | None = None
        self.slack = torch.full((len(heads),), math.inf, dtype=torch.float64)
        self.value_norms: Tensor | None = None  # (h, k) ‖v_j W_O^h‖
        self._pending = PendingSums()  # device-side sums of the blocks not yet flushed

    @property
    def rows(self) -> int:
        """Query rows kept so far (the same for every head)."""
        return 0 if self.per_head is None else int(self.per_head[ROWS, 0].round())

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
        is then not read. Rows that see a single key are left out (weighted 0): they cannot choose. The block is
        reduced on its own device (positions must be there too) and nothing is read back until :meth:`flush`.
        """
        device = weights.device
        dtype = accumulation_dtype(device)
        visible = allowed.sum(-1)  # (q,)
        keep = visible > 1  # (q,) rows that can choose between keys
        if entropy is None:
            entropy = attention_entropy(weights if weights.dtype == torch.float64 else weights.float())
        top, argmax = peak if peak is not None else weights.max(-1)  # (h, q)
        if radius is None:
            assert scores is not None, "scores are needed when the centred score norm is not given"
            radius = centred_score_norm(scores, allowed)
        # How far below the bound a row may fall before it counts as a violation: float32 rounding, or the ~2⁻⁸
        # relative rounding of weights stored in half precision (their entropy moves by up to ~1e-2 nats)
        tolerance = BOUND_TOLERANCE.get(weights.dtype, BOUND_TOLERANCE[torch.float32])
        entropy, top, radius = entropy.to(dtype), top.to(dtype), radius.to(dtype)
        weights = upcast(weights)
        kept = keep.expand_as(top)  # (h, q)
        ones = kept.to(dtype)  # 1 for a row that can choose, 0 for one that sees a single key

        def kept_sum(values: Tensor) -> Tensor:
            return torch.where(kept, values, 0.0).sum(-1)  # (h,)

        codes = row_targets(argmax, query_positions, sink_mask.to(device))  # (h, q)
        bound = zhai_entropy_bound(radius, visible.expand_as(radius).to(dtype))  # the Zhai et al. bound per row
        slack = torch.where(kept, entropy - bound, math.inf)
        per_head = [  # in the order of ENTROPY .. OUTPUT_NORM
            kept_sum(entropy),
            kept_sum(normalised_from_entropy(entropy, visible)),
            kept_sum(top),
            kept_sum(saturated(top, self.threshold).to(dtype)),
            kept_sum(radius),
            kept_sum(bound),
            (slack < -tolerance).to(dtype).sum(-1),
            ones.sum(-1),  # rows kept (the same for every head)
            *top.new_zeros(top.shape[0], len(ROW_TARGETS)).scatter_add_(1, codes, ones).T,
        ]
        if output_norms is not None:  # Σ rows of ‖head output‖
            per_head.append(kept_sum(output_norms.to(dtype)))
        self._pending.add("per_head", torch.stack(per_head))  # (n, h)
        self._pending.minimum("slack", slack.min(-1).values)  # (h,)
        self._add_keys(weights, argmax, ones, value_norms, dtype)

    def _add_keys(
        self, weights: Tensor, argmax: Tensor, ones: Tensor, value_norms: Tensor | None, dtype: torch.dtype
    ) -> None:
        """Per key, over the kept rows (``ones`` (h, q): 1 kept, 0 not): Σ weight, argmax counts and (with value
        norms) Σ of each key's share of ``Σ_j ‖α_ij v_j W_O^h‖``; (h, q, k) weights over key columns [0, k)."""
        heads, width = weights.shape[0], weights.shape[-1]
        per_key = weights.new_zeros(3 if value_norms is not None else 2, heads, self.keys, dtype=dtype)
        per_key[0, :, :width] = torch.einsum("hqk,hq->hk", weights, ones.to(weights.dtype)).to(dtype)
        per_key[1].scatter_add_(1, argmax, ones)
        if value_norms is not None:
            if self.value_norms is None:
                self._pending.first("value_norms", value_norms.to(dtype))  # (h, keys): the same for every chunk
            shares = value_share_sums(weights, value_norms[:, :width], rows=ones)
            per_key[2, :, :width] = shares.to(dtype)
        self._pending.add("per_key", per_key)

    def flush(self) -> None:
        """Move the device-side sums of the blocks added since the last flush to the CPU totals, in one copy."""
        if not self._pending:
            return
        parts = self._pending.take()  # the layer's one device-to-host copy
        if self.per_head is None or self.per_key is None:
            self.per_head, self.per_key = torch.zeros_like(parts["per_head"]), torch.zeros_like(parts["per_key"])
        self.per_head += parts["per_head"]
        self.per_key += parts["per_key"]
        self.slack = torch.minimum(self.slack, parts["slack"])
        if "value_norms" in parts:
            self.value_norms = parts["value_norms"].clone()

    def finish(self, sink_mask: Tensor) -> list[HeadCollapse]:
        self.flush()
        if self.rows == 0:
            return []
        return [self._head(i, head, sink_mask) for i, head in enumerate(self.heads)]

    def _head(self, i: int, head: int, sink_mask: Tensor) -> HeadCollapse:
        """The summary of head slot ``i`` (model head ``head``) from the sums."""
        assert self.per_head is not None and self.per_key is not None, "finish() flushes the sums first"
        n = float(self.rows)
        mean = self.per_head[:, i] / n  # (n,) every per-head sum as a mean over the kept rows
        column = self.per_key[0, i] / n
        dominant = int(column.argmax())
        counts = self.per_key[1, i].masked_fill(sink_mask, -1.0)
        top_other = int(counts.argmax()) if bool((counts > 0).any()) else None
        top_other_fraction = float(counts[top_other] / n) if top_other is not None else 0.0
        mean_max, saturated = float(mean[MAX_WEIGHT]), float(mean[SATURATED])
        concentrated = mean_max >= CONCENTRATED_MEAN_MAX or saturated >= CONCENTRATED_SATURATED
        sink, self_, previous = (
            float(mean[TARGETS + ROW_TARGETS.index(t)]) for t in ("sink", "self", "previous_token")
        )
        concentration = classify_concentration(sink, self_, previous, top_other_fraction)
        value = self._value_side(i, dominant, float(column[dominant]))
        return HeadCollapse(
            layer=self.layer,
            head=head,
            rows=self.rows,
            mean_entropy=float(mean[ENTROPY]),
            mean_normalised_entropy=float(mean[NORMALISED]),
            mean_max_weight=mean_max,
            saturated_fraction=saturated,
            dominant_position=dominant,
            dominant_share=float(column[dominant]),
            dominant_argmax_fraction=float(self.per_key[1, i, dominant] / n),
            sink_fraction=sink,
            self_fraction=self_,
            previous_fraction=previous,
            top_other_position=top_other,
            top_other_fraction=top_other_fraction,
            concentration=concentration,
            concentrated=concentrated,
            **asdict(value),
            mean_output_norm=float(mean[OUTPUT_NORM]) if len(mean) > OUTPUT_NORM else None,
            mean_centred_score_norm=float(mean[RADIUS]),
            mean_entropy_bound=float(mean[BOUND]),
            min_bound_slack=float(self.slack[i]),
            bound_violations=int(self.per_head[VIOLATIONS, i].round()),
            verdict=collapse_verdict(concentration, concentrated, value.contribution_ratio),
        )

    def _value_side(self, i: int, dominant: int, dominant_share: float) -> _ValueSide:
        """What the dominant key writes against an ordinary key (Kobayashi et al.), for head slot ``i``."""
        if self.value_norms is None or self.per_key is None or len(self.per_key) < 3:
            return _ValueSide()
        norms = self.value_norms[i]
        dominant_norm = float(norms[dominant])
        others = torch.cat([norms[:dominant], norms[dominant + 1 :]])
        other_norm = float(others.mean()) if others.numel() else 0.0
        contribution = dominant_share * dominant_norm  # mean_i α_ij* ‖v_j* W_O‖
        if other_norm > 0:
            norm_ratio: float | None = dominant_norm / other_norm
            contribution_ratio: float | None = contribution / other_norm
        elif contribution > 0:
            # only the dominant key writes anything: no finite ratio; None reads as "judge it a collapse"
            norm_ratio = contribution_ratio = None
        else:
            # no key writes anything (all value rows through W_O are zero): the head is a no-op whatever it reads
            norm_ratio, contribution_ratio = None, 0.0
        return _ValueSide(
            dominant_value_norm=dominant_norm,
            other_value_norm=other_norm,
            value_norm_ratio=norm_ratio,
            dominant_value_share=float(self.per_key[2, i, dominant] / self.rows),
            dominant_contribution=contribution,
            contribution_ratio=contribution_ratio,
        )


class CollapseConsumer:
    """Per layer and query chunk, turns the captured maps into running sums and drops them.

    Reads per-row tensors only up to ``key_width`` (later columns carry no weight), so causal chunks are
    computed over their visible keys only.

    Holds O(layers · heads · keys) numbers, never a map. With ``output_grams`` (per layer, (H, D, D)) it
    also measures the value side from the captured values: ‖v_j W_O^h‖ per key and ‖head output‖ per row.
    """

    accepts_key_prefix: ClassVar[bool] = True

    def __init__(
        self,
        sink_mask: Tensor,
        *,
        heads: Sequence[int] | None = None,
        threshold: float = SATURATION,
        output_grams: dict[int, Tensor] | None = None,
    ) -> None:
        self.sink_mask = sink_mask
        self.heads = list(heads) if heads is not None else None
        self.threshold = threshold
        self.output_grams = output_grams or {}
        self.layers: dict[int, HeadAccumulator] = {}
        self._layer_norms: tuple[int, Tensor] | None = None  # (layer, (h, Tk) on its device), for later chunks

    def on_layer(self, captured: LayerAttention) -> None:
        heads = self.heads if self.heads is not None else list(range(captured.weights.shape[1]))
        accumulator = self.layers.get(captured.layer)
        if accumulator is None:
            accumulator = HeadAccumulator(captured.layer, heads, captured.key_length, threshold=self.threshold)
            self.layers[captured.layer] = accumulator
        pick = _Picker(heads, captured.weights.shape[1])
        allowed = captured.allowed()[0, 0]  # (q, k)
        if captured.logits is not None:  # scores = logits where a key may be read: no second q·kᵀ
            radius = centred_logit_norm(pick(captured.logits[0]), allowed)  # (h, q)
        else:
            radius = centred_score_norm(pick(captured.scores[0]), allowed)
        top, argmax = captured.row_max()
        start = captured.key_index_offset
        positions = torch.arange(start, start + captured.weights.shape[2], device=captured.weights.device)
        if captured.stack == "cross":  # the keys are another sequence's: no key is the query itself or the one before
            positions = torch.full_like(positions, -2)
        value_norms, output_norms = self._value_norms(captured, pick)
        accumulator.add(
            pick(captured.weights[0]),
            None,
            allowed,
            positions,
            self.sink_mask.to(captured.weights.device),
            value_norms=value_norms,
            output_norms=output_norms,
            entropy=pick(captured.row_entropy()[0]),
            peak=(pick(top[0]), pick(argmax[0])),
            radius=radius,
        )
        if captured.last_chunk:
            accumulator.flush()  # the layer's last chunk: its sums cross to the CPU in one copy

    def _value_norms(self, captured: LayerAttention, pick: _Picker) -> tuple[Tensor | None, Tensor | None]:
        """(h, Tk) ‖v_j W_O^h‖ and (h, q) ‖head output‖ of this chunk, or (None, None) without Grams."""
        grams = self.output_grams.get(captured.layer)
        if grams is None:
            return None, None
        grams = grams.to(captured.value.device)  # read from the layer's own output projection: already there
        if self._layer_norms is not None and self._layer_norms[0] == captured.layer:
            value_norms = self._layer_norms[1]  # keys are the same for every query chunk
        else:
            value = captured.value[:1]  # (1, Hkv, Tk, D)
            value_norms = pick(transformed_value_norms(value, grams, kv_groups=captured.kv_groups)[0])  # (h, Tk)
            self._layer_norms = (captured.layer, value_norms)
        if captured.output is not None:
            outputs = projected_output_norms(captured.output[:1], grams)  # (1, H, q)
        else:
            outputs = head_output_norms(captured.weights[:1], captured.value[:1], grams, kv_groups=captured.kv_groups)
        return value_norms, pick(outputs[0])

    def results(self) -> list[HeadCollapse]:
        found: list[HeadCollapse] = []
        for layer in sorted(self.layers):
            found.extend(self.layers[layer].finish(self.sink_mask))
        return found


class _Picker:
    """Selects the kept heads along the first axis: (H, ...) -> (h, ...); the identity when every head is kept."""

    def __init__(self, heads: Sequence[int], num_heads: int) -> None:
        self.heads = list(heads)
        self.every_head = self.heads == list(range(num_heads))
        self.index: Tensor | None = None  # made on the device of the tensors it selects from

    def __call__(self, tensor: Tensor) -> Tensor:
        if self.every_head:
            return tensor
        if self.index is None or self.index.device != tensor.device:
            self.index = torch.tensor(self.heads, device=tensor.device)
        return tensor.index_select(0, self.index)


def output_grams_for(
    model: torch.nn.Module, layers: Sequence[int], num_heads: int, *, stack: str | None = None
) -> dict[int, Tensor]:
    """(H, D, D) Gram matrices of each requested layer's output projection in ``stack`` (None: the model's default
    stack), for :class:`CollapseConsumer`."""
    return {layer: head_output_grams(output_weight(model, layer, stack=stack), num_heads) for layer in layers}
