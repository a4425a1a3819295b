"""The scale sweep, streamed: one layer's q, k and scores by query chunk into variance and row-measure sums.

The measures (entropy, saturation, softmax Jacobian; dH/dβ's closed form) are :mod:`agent_tools.analysis.scaling`'s
and :mod:`agent_tools.analysis.metrics`'; this module keeps their running sums per scale setting. Each chunk is reduced
on the layer's device (the sweep in float32, upcast from half precision); only per-head sums cross to the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from agent_tools.analysis.metrics import masked_softmax, upcast
from agent_tools.analysis.scaling import (
    RowMeasures,
    SettingKind,
    predicted_dot_variance,
    row_measures,
)
from agent_tools.capture import LayerAttention, soft_capped
from agent_tools.consumers.host import PendingSums, accumulation_dtype


@dataclass
class SettingSums:
    """Running sums of the row measures for one scale setting."""

    kind: SettingKind
    temperature: float | None  # divides the model's logits (None for no_scaling)
    beta: float  # the factor applied to raw q·k (before any soft-cap)
    in_family: bool  # logits are model_logits / τ, so dH/dβ = −β Var_p(z) applies along the sweep
    rows: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    derivative: float = 0.0

    def block(self, measures: RowMeasures, derivative: Tensor | None, keep: Tensor) -> Tensor:
        """(8,) this block's sums on its device — the six measures, dH/dβ, rows — over the rows ``keep`` (h, q)
        marks (rows that can choose); :meth:`add` takes them once they are on the CPU."""
        dtype = accumulation_dtype(keep.device)
        zero = torch.zeros((), dtype=dtype, device=keep.device)
        sums = _sums(measures, keep, dtype)
        extra = torch.where(keep, derivative, 0.0).sum().to(dtype) if derivative is not None else zero
        return torch.cat([sums, extra[None], keep.sum().to(dtype)[None]])

    def add(self, sums: list[float], rescaled: bool) -> None:
        """The CPU copy of :meth:`block`'s sums (summed over a layer's chunks)."""
        for name, value in zip(_SUMMED, sums, strict=False):
            self.sums[name] = self.sums.get(name, 0.0) + value
        if rescaled:
            self.derivative += sums[len(_SUMMED)]
        self.rows += round(sums[len(_SUMMED) + 1])

    def means(self) -> dict[str, float]:
        n = max(self.rows, 1)
        return {name: value / n for name, value in self.sums.items()}


_SUMMED = {  # the sums a setting keeps -> the RowMeasures field each adds up
    "entropy": "entropy",
    "normalised_entropy": "normalised_entropy",
    "mean_max_weight": "max_weight",
    "saturated_fraction": "saturated",
    "jacobian_trace": "jacobian_trace",
    "jacobian_frobenius": "jacobian_frobenius",
}


def _sums(measures: RowMeasures, keep: Tensor, dtype: torch.dtype) -> Tensor:
    """(6,) sums of the row measures over the rows ``keep`` marks, in the order of ``_SUMMED``, on their device."""
    measured = [getattr(measures, field) for field in _SUMMED.values()]
    return torch.stack([torch.where(keep, value.to(dtype), 0.0).sum() for value in measured])


class ScalingConsumer:
    """One layer's q, k and scores streamed by query chunk into variance and scale-sweep sums.

    Reads per-row tensors up to ``key_width`` only (the causal part of a chunk is all it computes).

    ``model_scale`` is the factor the model applies to q·k (for query-prescaled families the captured query
    already carries it and is divided back out). Rows that see a single key are left out of the sweep.
    """

    accepts_key_prefix: ClassVar[bool] = True

    def __init__(
        self,
        layer: int,
        heads: Sequence[int],
        temperatures: Sequence[float],
        *,
        model_scale: float,
        query_prescaled: bool = False,
    ) -> None:
        self.layer, self.heads = layer, list(heads)
        self.model_scale, self.query_prescaled = model_scale, query_prescaled
        self.temperatures = sorted(set(temperatures) | {1.0}, reverse=True)  # β ascending along the family
        n = len(self.heads)
        self.q_sum: Tensor | None = None  # (h, D) running sums over query rows
        self.q_sq: Tensor | None = None
        self.q_rows = 0
        self.k_mean: Tensor | None = None  # (h, D) over keys
        self.k_var: Tensor | None = None
        self.raw_n = torch.zeros(n, dtype=torch.float64)  # sums on the CPU; each chunk adds its per-head sums
        self.raw_sum = torch.zeros(n, dtype=torch.float64)
        self.raw_sq = torch.zeros(n, dtype=torch.float64)
        self.settings: list[SettingSums] = []
        self.softcap: float | None = None
        self.monotone_rows = 0
        self.monotone_violations = 0
        self.head_dim = 0
        self._pending = PendingSums()  # this layer's sums on its device until its last chunk

    def on_layer(self, captured: LayerAttention) -> None:
        if captured.layer != self.layer:
            return
        index = torch.tensor(self.heads, device=captured.query.device)
        dtype = accumulation_dtype(captured.query.device)  # float64 on the CPU, float32 on an accelerator
        query = captured.query[0].index_select(0, index).to(dtype)  # (h, q, D)
        if self.query_prescaled:
            query = query / self.model_scale
        width = captured.key_width  # key columns of this chunk's rows (later ones carry no weight)
        key = captured.head_key(captured.key)[0].index_select(0, index).to(dtype)  # (h, Tk, D)
        # (h, q, k) the model's scores where a key may be read: the softmax input equals them there (the mask adds
        # 0), so no second q·kᵀ; hidden keys are masked below.
        source = captured.logits if captured.logits is not None else captured.scores
        scores = source[0].index_select(0, index)
        allowed = captured.allowed()[0, 0]  # (q, k)
        self.softcap = captured.softcap
        self.head_dim = query.shape[-1]
        self._add_moments(query, key)
        # (h, q, k) q·k with no scale, in float32 like the capture itself (the variance's sums are float64): a
        # float64 product of a 2,048-token layer costs twice the time and memory for digits the sweep drops anyway
        raw = query.float() @ key[:, :width].float().transpose(-1, -2)
        self._add_raw_variance(raw, allowed)
        keep = allowed.sum(-1) > 1  # (q,) rows that can choose; the others are weighted 0 (no host read)
        if scores.dtype not in (torch.float32, torch.float64):
            # A half-precision model's scores were rounded (~2⁻⁸ in bf16) after q·k: the sweep's settings would then
            # compare softmaxes of two slightly different score sets (raw vs rounded). Rebuild them in float32
            # from the same q·k, so every setting rescales one z (exact for the model's softmax up to that rounding).
            # raw is the unscaled q·k (a prescaled query was divided back above)
            scores = soft_capped(raw * self.model_scale, self.softcap)
        # The sweep runs in float32 (the capture's precision; sums are taken in float64): half the memory traffic.
        self._sweep(raw, upcast(scores), allowed, keep)
        if captured.last_chunk:
            self._flush()  # the layer's last chunk: its sums cross to the CPU in one copy

    def _add_moments(self, query: Tensor, key: Tensor) -> None:
        """Running q moments over query rows (h, q, D); k moments (h, Tk, D) from the first chunk (same keys)."""
        if not self.settings:
            self._make_settings()
        self._pending.first("k_moments", torch.stack([key.mean(1), key.var(1, unbiased=False)]))  # (2, h, D)
        self._pending.add("q_moments", torch.stack([query.sum(1), query.pow(2).sum(1)]))  # (2, h, D)
        self.q_rows += query.shape[1]

    def _add_raw_variance(self, raw: Tensor, allowed: Tensor) -> None:
        """Sums for Var(q·k) over the pairs the model may score: raw (h, q, k) unscaled q·k, allowed (q, k)."""
        dtype = accumulation_dtype(raw.device)
        pairs = allowed.expand(raw.shape)
        masked = raw.masked_fill(~pairs, 0.0)  # (h, q, k) q·k of the pairs the model may score
        sums = masked.sum((-2, -1), dtype=dtype)
        squares = (masked * masked).sum((-2, -1), dtype=dtype)
        pairs_n = allowed.sum().to(dtype).expand_as(sums)
        self._pending.add("raw", torch.stack([sums, squares, pairs_n]))  # (3, h)

    def _sweep(self, raw: Tensor, scores: Tensor, allowed: Tensor, keep: Tensor) -> None:
        """Row measures at every scale setting over the rows that can choose (``keep`` (q,)): (h, q, k) raw q·k,
        scores; (q, k)."""
        visible_scores = scores.masked_fill(~allowed, 0.0)  # (h, q, k) z where a key may be read
        visible_squares = visible_scores * visible_scores
        kept = keep.expand(scores.shape[:-1])  # (h, q)
        family_entropies = []
        blocks = []
        for setting in self.settings:
            temperature = setting.temperature if setting.kind != "no_scaling" else None
            rescaled = temperature is not None
            logits = scores / temperature if temperature is not None else soft_capped(raw, self.softcap)
            weights = masked_softmax(logits, allowed)
            derivative = None
            if rescaled:  # p = softmax(scores / τ) = softmax(β' · z), β' = 1 / τ: dH/dβ' = −β' Var_p(z)
                first = torch.einsum("hqk,hqk->hq", weights, visible_scores)  # E_p[z]
                second = torch.einsum("hqk,hqk->hq", weights, visible_squares)  # E_p[z²]
                derivative = -(setting.beta / self.model_scale) * (second - first * first).clamp_min(0.0)
            measures = row_measures(weights, allowed)  # saturation at the glossary's SATURATION
            blocks.append(setting.block(measures, derivative, kept))
            if setting.in_family:
                family_entropies.append((setting.beta, measures.entropy))
        self._pending.add("settings", torch.stack(blocks))  # (settings, 8)
        family_entropies.sort(key=lambda item: item[0])
        stacked = torch.stack([e for _, e in family_entropies])  # (settings, h, q), β ascending
        tolerance = 1e-9 if stacked.dtype == torch.float64 else 1e-5  # float32 rounding of equal entropies
        rises = (stacked[1:] > stacked[:-1] + tolerance).any(0) & kept  # (h, q)
        self._pending.add("monotone", torch.stack([kept.sum(), rises.sum()]))  # (2,) rows, violations

    def _flush(self) -> None:
        """Add the layer's device-side sums (moved in one copy) to the CPU totals."""
        sums = self._pending.take()
        if not sums:
            return
        if self.k_mean is None:
            self.k_mean, self.k_var = sums["k_moments"]
        q_sum, q_sq = sums["q_moments"]
        self.q_sum = q_sum if self.q_sum is None else self.q_sum + q_sum
        self.q_sq = q_sq if self.q_sq is None else self.q_sq + q_sq
        raw_sum, raw_sq, raw_n = sums["raw"]
        self.raw_sum += raw_sum
        self.raw_sq += raw_sq
        self.raw_n += raw_n
        for setting, values in zip(self.settings, sums["settings"].tolist(), strict=True):  # CPU: no sync
            setting.add(values, rescaled=setting.kind != "no_scaling")
        rows, violations = sums["monotone"].tolist()
        self.monotone_rows += round(rows)
        self.monotone_violations += round(violations)

    def _make_settings(self) -> None:
        for temperature in self.temperatures:
            kind: SettingKind = "model_scale" if temperature == 1.0 else "temperature"
            self.settings.append(SettingSums(kind, temperature, self.model_scale / temperature, in_family=True))
        self.settings.append(SettingSums("no_scaling", None, 1.0, in_family=self.softcap is None))

    # --- results ---------------------------------------------------------------------------------------
    def variances(self) -> dict[str, Tensor]:
        """Per head: measured Var(q·k), Var(scaled scores), predicted Var(q·k) and the q/k moments."""
        if self.q_sum is None or self.q_sq is None or self.k_mean is None or self.k_var is None:
            raise RuntimeError(f"layer {self.layer} was not captured")
        n = self.raw_n.clamp_min(1)
        raw_var = self.raw_sq / n - (self.raw_sum / n).pow(2)
        scaled_var = raw_var * self.model_scale**2  # Var(c·x) = c² Var(x)
        q_mean = self.q_sum / self.q_rows
        q_var = (self.q_sq / self.q_rows - q_mean.pow(2)).clamp_min(0.0)
        isotropic, independent = predicted_dot_variance(q_mean, q_var, self.k_mean, self.k_var)
        return {
            "raw_variance": raw_var,
            "scaled_variance": scaled_var,
            "predicted_isotropic": isotropic,
            "predicted_independent": independent,
            "q_variance": q_var.mean(-1),
            "k_variance": self.k_var.mean(-1),
            "q_mean_square": q_mean.pow(2).mean(-1),
            "k_mean_square": self.k_mean.pow(2).mean(-1),
            "pairs": self.raw_n,
        }
