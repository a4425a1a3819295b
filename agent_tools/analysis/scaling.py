"""What the 1/sqrt(d_k) factor does: score variance, softmax saturation, and the softmax's gradient.

For a query q and key k with independent components of variance σ_q², σ_k², the dot product q·k has variance
``d_k·σ_q²·σ_k²``: it grows with the head dimension, and softmax over scores with standard deviation
``sqrt(d_k)`` saturates onto one key. The softmax Jacobian ``J = diag(p) − p pᵀ`` then vanishes, so no gradient
flows back into W_q and W_k. Dividing by sqrt(d_k) restores unit variance.

Closed forms used per row (``p`` a probability vector):

* ``tr J = 1 − Σ p²`` and ``‖J‖_F² = Σ p² − 2 Σ p³ + (Σ p²)²``;
* for ``p = softmax(β z)``: ``dH/dβ = −β · Var_p(z) ≤ 0`` — entropy never rises as the scale grows (the sweep
  computes it from the moments, ``−β (E_p[z²] − E_p[z]²)``, with the row's other sums).

Entropy, normalised entropy and the masked softmax are :mod:`agent_tools.analysis.metrics`'; the streamed sweep
(``ScalingConsumer``) lives in :mod:`agent_tools.consumers.scaling`.

Shapes: ``...`` leading dims (heads), ``q`` query rows, ``k`` keys, ``D`` head_dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor, nn

from agent_tools.analysis.metrics import (
    SATURATION,
    attention_entropy,
    normalised_entropy,
    saturated,
    upcast,
)

SYNTHETIC_HEAD_DIMS = (16, 64, 256, 1024)
SettingKind = Literal["model_scale", "no_scaling", "temperature"]


# --- per-row measures ---------------------------------------------------------------------------------------


def _jacobian_measures(weights: Tensor) -> tuple[Tensor, Tensor]:
    """(..., k) -> trace and Frobenius norm of the softmax Jacobian J = diag(p) − p pᵀ: ``tr J = 1 − Σ p²`` and
    ``‖J‖_F = sqrt(Σ p² − 2 Σ p³ + (Σ p²)²)``, from Σ p² and Σ p³ (one temporary).

    Half-precision weights are upcast to float32."""
    weights = upcast(weights)
    squared = weights * weights
    sum_squares = squared.sum(-1)  # Σ p²
    sum_cubes = torch.einsum("...k,...k->...", squared, weights)  # Σ p³
    frobenius = (sum_squares - 2 * sum_cubes + sum_squares.pow(2)).clamp_min(0.0).sqrt()
    return 1.0 - sum_squares, frobenius


@dataclass(frozen=True)
class RowMeasures:
    """Per-row measures of a weight map: (..., q) each."""

    entropy: Tensor
    normalised_entropy: Tensor
    max_weight: Tensor
    saturated: Tensor
    jacobian_trace: Tensor
    jacobian_frobenius: Tensor


def row_measures(weights: Tensor, allowed: Tensor | None = None, *, saturation: float = SATURATION) -> RowMeasures:
    """(..., q, k) weights -> entropy (nats), entropy / log(visible keys), max, saturated, Jacobian trace/‖·‖_F.

    Half-precision weights are upcast to float32 first."""
    weights = upcast(weights)
    entropy = attention_entropy(weights)
    normalised = normalised_entropy(weights, allowed, entropy=entropy)
    top = weights.amax(-1)
    trace, frobenius = _jacobian_measures(weights)
    return RowMeasures(
        entropy=entropy,
        normalised_entropy=normalised,
        max_weight=top,
        saturated=saturated(top, saturation),
        jacobian_trace=trace,
        jacobian_frobenius=frobenius,
    )


def predicted_dot_variance(q_mean: Tensor, q_var: Tensor, k_mean: Tensor, k_var: Tensor) -> tuple[Tensor, Tensor]:
    """Per-component moments (..., D) of q and k -> (isotropic, independent) predicted Var(q·k), each (...).

    * isotropic: ``mean_d σ²_q · mean_d σ²_k · d_k`` — the textbook ``var(q)·var(k)·d_k``;
    * independent: ``Σ_d σ²_q,d σ²_k,d + σ²_q,d μ²_k,d + μ²_q,d σ²_k,d`` — exact when q and k are independent
      with independent components, whatever their means and per-component variances.
    """
    head_dim = q_var.shape[-1]
    isotropic = q_var.mean(-1) * k_var.mean(-1) * head_dim
    independent = (q_var * k_var + q_var * k_mean.pow(2) + q_mean.pow(2) * k_var).sum(-1)
    return isotropic, independent


# --- the synthetic demonstration ------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticScaling:
    head_dim: int
    dot_variance: float  # Var(q·k) for unit-variance components: ≈ d_k
    scaled_variance: float  # Var(q·k / sqrt(d_k)): ≈ 1
    unscaled: dict[str, float]
    scaled: dict[str, float]


def _means(measures: RowMeasures) -> dict[str, float]:
    return {
        "entropy": float(measures.entropy.mean()),
        "normalised_entropy": float(measures.normalised_entropy.mean()),
        "mean_max_weight": float(measures.max_weight.mean()),
        "saturated_fraction": float(measures.saturated.double().mean()),
        "jacobian_trace": float(measures.jacobian_trace.mean()),
        "jacobian_frobenius": float(measures.jacobian_frobenius.mean()),
    }


def synthetic_scaling_demo(
    head_dims: Sequence[int] = SYNTHETIC_HEAD_DIMS, *, queries: int = 256, keys: int = 64, seed: int = 0
) -> list[SyntheticScaling]:
    """Random unit-variance q, k for each d_k: score variance, saturation and softmax gradient with/without scale."""
    generator = torch.Generator().manual_seed(seed)
    results = []
    for head_dim in head_dims:
        q = torch.randn(queries, head_dim, generator=generator, dtype=torch.float64)
        k = torch.randn(keys, head_dim, generator=generator, dtype=torch.float64)
        dots = q @ k.T  # (queries, keys)
        scaled = dots / math.sqrt(head_dim)
        results.append(
            SyntheticScaling(
                head_dim=head_dim,
                dot_variance=float(dots.var(unbiased=False)),
                scaled_variance=float(scaled.var(unbiased=False)),
                unscaled=_means(row_measures(torch.softmax(dots, -1))),
                scaled=_means(row_measures(torch.softmax(scaled, -1))),
            )
        )
    return results


# --- the training experiment ---------------------------------------------------------------------------


class RetrievalAttention(nn.Module):
    """One attention head that retrieves an item's label with a query: the smallest model of attention.

    Items are random content vectors ``c_j`` with labels ``y_j``; the query is a noisy copy of one item.
    ``q = x_query W_q``, ``k_j = c_j W_k``, ``α = softmax(q·k_j · s)`` with ``s = 1/sqrt(d_k)`` or 1, and the
    values are the labels as one-hot vectors read out with a fixed gain: ``logits = gain · Σ_j α_j e_{y_j}``.
    Only W_q and W_k learn, so every bit of learning has to pass back through the softmax.
    """

    def __init__(self, d_model: int, head_dim: int, *, scaled: bool, gain: float, generator: torch.Generator):
        super().__init__()
        self.scaled, self.head_dim, self.gain = scaled, head_dim, gain
        # N(0, 1/d_model) weights: unit-variance q and k components for unit-variance inputs.
        self.w_q = nn.Parameter(torch.randn(d_model, head_dim, generator=generator) / math.sqrt(d_model))
        self.w_k = nn.Parameter(torch.randn(d_model, head_dim, generator=generator) / math.sqrt(d_model))

    def forward(self, items: Tensor, labels: Tensor, query: Tensor, num_labels: int) -> tuple[Tensor, Tensor]:
        """items (B, N, C), labels (B, N), query (B, C) -> logits (B, num_labels), weights (B, N)."""
        # q·k_j = x W_q (c_j W_k)ᵀ = x (W_q W_kᵀ) c_jᵀ: the same numbers and gradients, C·C·D work per step.
        bilinear = self.w_q @ self.w_k.T  # (C, C)
        scores = (items @ (query @ bilinear)[:, :, None]).squeeze(-1)  # (B, N)
        if self.scaled:
            scores = scores / math.sqrt(self.head_dim)
        weights = torch.softmax(scores, dim=-1)
        values = nn.functional.one_hot(labels, num_labels).to(weights.dtype)  # (B, N, labels)
        read = (weights[:, :, None] * values).sum(1)  # (B, labels)
        return self.gain * read, weights


@dataclass(frozen=True)
class ExperimentRun:
    head_dim: int
    scaled: bool
    steps: list[int]
    loss: list[float]
    accuracy: list[float]
    grad_norm_q: list[float]
    grad_norm_k: list[float]
    attention_entropy: list[float]
    saturated_fraction: list[float]
    target_weight: list[float]


def retrieval_batch(
    batch: int, items: int, d_model: int, labels: int, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random items (B, N, C), their labels (B, N), a noisy copy of one item as the query (B, C), its index (B,)."""
    contents = torch.randn(batch, items, d_model, generator=generator)
    item_labels = torch.randint(0, labels, (batch, items), generator=generator)
    target = torch.randint(0, items, (batch,), generator=generator)
    noise = 0.1 * torch.randn(batch, d_model, generator=generator)
    query = contents[torch.arange(batch, device=contents.device), target] + noise
    return contents, item_labels, query, target


def train_retrieval(
    head_dim: int,
    *,
    scaled: bool,
    steps: int = 300,
    batch: int = 64,
    items: int = 16,
    d_model: int = 32,
    labels: int = 16,
    gain: float = 8.0,
    learning_rate: float = 1.0,
    log_every: int = 10,
    seed: int = 0,
    checkpoint: Callable[[], None] | None = None,
) -> ExperimentRun:
    """Train :class:`RetrievalAttention` with SGD; deterministic for a seed (same data and init for every run).

    ``checkpoint`` is called before every step (a call's cancel flag and deadline): what it raises stops the
    training there.

    Runs on one intra-op thread (restored afterwards): these ops are tiny, and on a shared CPU more threads only
    add contention. The result does not depend on it.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    curves = [f.name for f in fields(ExperimentRun) if f.name not in ("head_dim", "scaled", "steps")]
    logged: dict[str, list[float]] = {name: [] for name in curves}  # ExperimentRun's curves, by field
    logged_steps: list[int] = []
    try:
        with torch.enable_grad():
            init = torch.Generator().manual_seed(seed)
            data = torch.Generator().manual_seed(seed + 1)
            model = RetrievalAttention(d_model, head_dim, scaled=scaled, gain=gain, generator=init)
            optimiser = torch.optim.SGD(model.parameters(), lr=learning_rate)
            for step in range(steps + 1):
                if checkpoint is not None:
                    checkpoint()
                contents, item_labels, query, target = retrieval_batch(batch, items, d_model, labels, data)
                logits, weights = model(contents, item_labels, query, labels)
                answer = item_labels[torch.arange(batch, device=item_labels.device), target]
                loss = nn.functional.cross_entropy(logits, answer)
                optimiser.zero_grad()
                loss.backward()
                if step % log_every == 0 or step == steps:
                    logged_steps.append(step)
                    with torch.no_grad():
                        logged["loss"].append(float(loss))
                        logged["accuracy"].append(float((logits.argmax(-1) == answer).float().mean()))
                        logged["grad_norm_q"].append(float(model.w_q.grad.norm()))  # type: ignore[union-attr]
                        logged["grad_norm_k"].append(float(model.w_k.grad.norm()))  # type: ignore[union-attr]
                        logged["attention_entropy"].append(float(attention_entropy(weights).mean()))
                        logged["saturated_fraction"].append(float(saturated(weights.max(-1).values).float().mean()))
                        chosen = weights[torch.arange(batch, device=weights.device), target]
                        logged["target_weight"].append(float(chosen.mean()))
                if step < steps:
                    optimiser.step()
    finally:
        torch.set_num_threads(threads)
    return ExperimentRun(head_dim=head_dim, scaled=scaled, steps=logged_steps, **logged)
