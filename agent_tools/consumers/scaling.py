"""The scale sweep, streamed: one layer's q, k and scores by query chunk into variance and row-measure sums.

The measures (entropy, saturation, softmax Jacobian, dH/dβ) are :mod:`agent_tools.analysis.scaling`'s and
:mod:`agent_tools.analysis.metrics`'; this module keeps their running sums per scale setting. Each chunk is reduced
on the layer's device (the sweep in float32, upcast from half precision); only per-head sums cross to the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from agent_tools.analysis.metrics import SATURATION, masked_softmax, upcast
from agent_tools.analysis.scaling import (
    RowMeasures,
    SettingKind,
    predicted_dot_variance,
    row_measures,
)
from agent_tools.capture import LayerAttention
from agent_tools.consumers.host import to_host


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

    def add(self, measures: RowMeasures, derivative: Tensor | None) -> None:
        self.rows += measures.entropy.numel()
        sums = _sums(measures)
        if derivative is not None:
            sums = torch.cat([sums, derivative.sum().double()[None]])
        values = sums.tolist()  # the chunk's sums, read from the layer's device at once
        for name, value in zip(_SUMMED, values, strict=False):
            self.sums[name] = self.sums.get(name, 0.0) + value
        if derivative is not None:
            self.derivative += values[-1]

    def means(self) -> dict[str, float]:
        n = max(self.rows, 1)
        return {name: value / n for name, value in self.sums.items()}


_SUMMED = (
    "entropy",
    "normalised_entropy",
    "mean_max_weight",
    "saturated_fraction",
    "jacobian_trace",
    "jacobian_frobenius",
)


def _sums(measures: RowMeasures) -> Tensor:
    """(6,) float64 sums of the row measures, in the order of ``_SUMMED``, on the measures' device."""
    return torch.stack(
        [
            measures.entropy.double().sum(),
            measures.normalised_entropy.double().sum(),
            measures.max_weight.double().sum(),
            measures.saturated.double().sum(),
            measures.jacobian_trace.double().sum(),
            measures.jacobian_frobenius.double().sum(),
        ]
    )


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
        saturation: float = SATURATION,
        batch_index: int = 0,
    ) -> None:
        self.layer, self.heads = layer, list(heads)
        self.model_scale, self.query_prescaled = model_scale, query_prescaled
        self.saturation, self.batch_index = saturation, batch_index
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

    def on_layer(self, captured: LayerAttention) -> None:
        if captured.layer != self.layer:
            return
        b = self.batch_index
        index = torch.tensor(self.heads, device=captured.query.device)
        query = captured.query[b].index_select(0, index).double()  # (h, q, D)
        if self.query_prescaled:
            query = query / self.model_scale
        width = captured.key_width  # key columns of this chunk's rows (later ones carry no weight)
        key = captured.head_key(captured.key)[b].index_select(0, index).double()  # (h, Tk, D)
        # (h, q, k) the model's scores where a key may be read: the softmax input equals them there (the mask adds
        # 0), so no second q·kᵀ; hidden keys are masked below.
        source = captured.logits if captured.logits is not None else captured.scores
        scores = source[b].index_select(0, index)
        allowed = captured.allowed()[b, 0]  # (q, k)
        self.softcap = captured.softcap
        self.head_dim = query.shape[-1]
        self._add_moments(query, key)
        # (h, q, k) q·k with no scale, in float32 like the capture itself (the variance's sums are float64): a
        # float64 product of a 2,048-token layer costs twice the time and memory for digits the sweep drops anyway
        raw = query.float() @ key[:, :width].float().transpose(-1, -2)
        self._add_raw_variance(raw, allowed)
        keep = allowed.sum(-1) > 1  # rows that can choose
        if not bool(keep.any()):
            return
        if scores.dtype not in (torch.float32, torch.float64):
            # A half-precision model's scores were rounded (~2⁻⁸ in bf16) after q·k: the sweep's settings would then
            # compare softmaxes of two slightly different score sets (raw vs rounded). Rebuild them in float32
            # from the same q·k, so every setting rescales one z (exact for the model's softmax up to that rounding).
            scaled = raw * self.model_scale  # raw is the unscaled q·k (a prescaled query was divided back above)
            scores = torch.tanh(scaled / self.softcap) * self.softcap if self.softcap is not None else scaled
        # The sweep runs in float32 (the capture's precision; sums are taken in float64): half the memory traffic.
        self._sweep(raw[:, keep], upcast(scores[:, keep]), allowed[keep])

    def _add_moments(self, query: Tensor, key: Tensor) -> None:
        """Running q moments over query rows (h, q, D); k moments (h, Tk, D) from the first chunk (same keys)."""
        if self.q_sum is None or self.q_sq is None:
            self.q_sum = torch.zeros(query.shape[0], query.shape[-1], dtype=torch.float64)
            self.q_sq = torch.zeros_like(self.q_sum)
            self.k_mean, self.k_var = to_host(torch.stack([key.mean(1), key.var(1, unbiased=False)]))
            self._make_settings()
        q_sum, q_sq = to_host(torch.stack([query.sum(1), query.pow(2).sum(1)]))  # (h, D) each
        self.q_sum = self.q_sum + q_sum
        self.q_sq = self.q_sq + q_sq
        self.q_rows += query.shape[1]

    def _add_raw_variance(self, raw: Tensor, allowed: Tensor) -> None:
        """Sums for Var(q·k) over the pairs the model may score: raw (h, q, k) unscaled q·k, allowed (q, k)."""
        pairs = allowed.expand(raw.shape)
        masked = raw.masked_fill(~pairs, 0.0)  # (h, q, k) q·k of the pairs the model may score
        self.raw_n += float(allowed.sum())
        sums = masked.sum((-2, -1), dtype=torch.float64)
        squares = (masked * masked).sum((-2, -1), dtype=torch.float64)
        raw_sum, raw_sq = to_host(torch.stack([sums, squares]))
        self.raw_sum += raw_sum
        self.raw_sq += raw_sq

    def _sweep(self, raw: Tensor, scores: Tensor, allowed: Tensor) -> None:
        """Row measures at every scale setting, on the rows that can choose: (h, q, k) raw q·k, scores; (q, k)."""
        visible_scores = scores.masked_fill(~allowed, 0.0)  # (h, q, k) z where a key may be read
        visible_squares = visible_scores * visible_scores
        family_entropies = []
        for setting in self.settings:
            temperature = setting.temperature if setting.kind != "no_scaling" else None
            rescaled = temperature is not None
            if temperature is not None:
                logits = scores / temperature
            else:
                logits = raw if self.softcap is None else torch.tanh(raw / self.softcap) * self.softcap
            weights = masked_softmax(logits, allowed)
            derivative = None
            if rescaled:  # p = softmax(scores / τ) = softmax(β' · z), β' = 1 / τ: dH/dβ' = −β' Var_p(z)
                first = torch.einsum("hqk,hqk->hq", weights, visible_scores)  # E_p[z]
                second = torch.einsum("hqk,hqk->hq", weights, visible_squares)  # E_p[z²]
                derivative = -(setting.beta / self.model_scale) * (second - first * first).clamp_min(0.0)
            measures = row_measures(weights, allowed, saturation=self.saturation)
            setting.add(measures, derivative)
            if setting.in_family:
                family_entropies.append((setting.beta, measures.entropy))
        family_entropies.sort(key=lambda item: item[0])
        stacked = torch.stack([e for _, e in family_entropies])  # (settings, h, q), β ascending
        tolerance = 1e-9 if stacked.dtype == torch.float64 else 1e-5  # float32 rounding of equal entropies
        rises = stacked[1:] > stacked[:-1] + tolerance
        self.monotone_rows += stacked[0].numel()
        self.monotone_violations += int(rises.any(0).sum())

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
