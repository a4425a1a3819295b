"""How a head's projections shape its attention: spectra, subspaces, and attention without projections.

Pure tensor functions. Conventions: a projection ``w`` is ``(d_model, d_head)`` with ``q = x @ w`` (see
:mod:`agent_tools.layout`), so the subspace of the input a projection *reads* is the column space of ``w``
in R^d_model (the row space of transformers' ``(out, in)`` weight). Attention maps are ``(..., q, k)`` rows
that sum to one; ``allowed`` marks the keys each query may read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_tools.analysis.metrics import (
    allowed_from_additive_mask,
    attention_entropy,
)
from agent_tools.analysis.metrics import masked_softmax as metrics_masked_softmax

RANK_TOLERANCE = 1e-10  # singular values below this times the largest span nothing


@dataclass(frozen=True)
class Spectrum:
    """Norms and singular values of one matrix (float64 internally)."""

    singular_values: Tensor  # (min(m, n),) descending
    frobenius_norm: float
    spectral_norm: float
    effective_rank: float  # Roy & Vetterli (2007): exp(entropy of σ / Σσ)
    stable_rank: float  # ‖W‖_F² / ‖W‖_2²


def effective_rank(singular_values: Tensor) -> float:
    """Roy & Vetterli's entropy effective rank: exp(H(p)), p_i = σ_i / Σ_j σ_j (nats).

    Equals the rank for equal non-zero singular values, 1 for rank one, and lies in [1, rank] otherwise.
    """
    sigma = singular_values.double().clamp_min(0)
    total = sigma.sum()
    if total <= 0:
        return 0.0
    return float(attention_entropy(sigma / total).exp())


def matrix_spectrum(weight: Tensor) -> Spectrum:
    """Singular values, Frobenius and spectral norm, effective and stable rank of a 2-D matrix."""
    sigma = torch.linalg.svdvals(weight.double())  # (min(m, n),) descending
    spectral = float(sigma[0]) if sigma.numel() else 0.0
    frobenius = float(sigma.square().sum().sqrt())
    return Spectrum(
        singular_values=sigma,
        frobenius_norm=frobenius,
        spectral_norm=spectral,
        effective_rank=effective_rank(sigma),
        stable_rank=frobenius**2 / spectral**2 if spectral > 0 else 0.0,
    )


def orthonormal_basis(columns: Tensor, *, tolerance: float = RANK_TOLERANCE) -> Tensor:
    """(n, k) -> (n, r): an orthonormal basis of the column space (r = numerical rank)."""
    u, sigma, _ = torch.linalg.svd(columns.double(), full_matrices=False)  # u (n, k)
    if sigma.numel() == 0 or sigma[0] == 0:
        return u[:, :0]
    rank = int((sigma > tolerance * sigma[0]).sum())
    return u[:, :rank]


def principal_angles(a: Tensor, b: Tensor) -> Tensor:
    """Principal angles (radians, ascending) between the column spaces of ``a`` (n, k) and ``b`` (n, l).

    cos θ_i are the singular values of U_aᵀ U_b for orthonormal bases U_a, U_b (Björck & Golub 1973);
    there are min(rank a, rank b) angles. 0 = a shared direction, π/2 = orthogonal directions.
    """
    basis_a, basis_b = orthonormal_basis(a), orthonormal_basis(b)
    cosines = torch.linalg.svdvals(basis_a.T @ basis_b).clamp(0.0, 1.0)  # (min(ra, rb),) descending
    return torch.arccos(cosines)


def random_subspace_cos2(dim_a: int, dim_b: int, ambient: int) -> float:
    """Expected mean cos² of the principal angles between random subspaces: max(dim_a, dim_b) / ambient."""
    return min(1.0, max(dim_a, dim_b) / ambient)


def qk_symmetric_share(w_q: Tensor, w_k: Tensor) -> float:
    """Share of ‖W_Q W_Kᵀ‖_F² in its symmetric part: 1 = a similarity-like bilinear form (x_i·M·x_j = x_j·M·x_i),
    0.5 for a random one, 0 = purely antisymmetric."""
    m = w_q.double() @ w_k.double().T  # (d_model, d_model)
    total = m.square().sum()
    if total == 0:
        return 0.0
    symmetric = 0.5 * (m + m.T)
    return float(symmetric.square().sum() / total)


def qk_identity_alignment(w_q: Tensor, w_k: Tensor) -> float:
    """Cosine between W_Q W_Kᵀ and the identity: tr(M) / (‖M‖_F·sqrt(d_model)). 1 = plain x·x (scaled),
    ≈0 = unrelated to the raw dot product, <0 = prefers dissimilar tokens."""
    m = w_q.double() @ w_k.double().T
    norm = m.square().sum().sqrt()
    if norm == 0:
        return 0.0
    return float(torch.trace(m) / (norm * math.sqrt(m.shape[0])))


def matrix_cosine(a: Tensor, b: Tensor) -> float:
    """Cosine similarity of two same-shape matrices, flattened."""
    a64, b64 = a.double().flatten(), b.double().flatten()
    denominator = a64.norm() * b64.norm()
    return float(a64 @ b64 / denominator) if denominator > 0 else 0.0


def no_projection_attention(x: Tensor, scaling: float, mask: Tensor | None = None) -> Tensor:
    """(T, d_model) -> (T, T): attention with Q = K = x (no W_Q, W_K, no positions), same scale and mask.

    ``mask``: the model's additive mask (0 where a key may be read, dtype-min where not), or None.
    With V = x as well, the output would be ``weights @ x``: each token mixes the raw inputs it resembles.
    """
    scores = (x.float() @ x.float().T) * scaling  # (T, T)
    return metrics_masked_softmax(scores, allowed_from_additive_mask(mask) if mask is not None else None)


def self_argmax_fraction(weights: Tensor, allowed: Tensor | None = None) -> float:
    """(q, k) square map -> fraction of queries whose largest weight is on themselves (key index = query index).

    With ``allowed`` (q, k) bool, queries that may read only one key (the first token under a causal mask) are
    left out: they attend to themselves by construction, not by choice.
    """
    rows = weights.shape[-2]
    is_self = weights.argmax(-1) == torch.arange(rows, device=weights.device)  # (q,)
    if allowed is not None:
        choosing = allowed.sum(-1) > 1
        if not bool(choosing.any()):
            return 0.0
        is_self = is_self[choosing]
    return float(is_self.double().mean())


def self_share(weights: Tensor) -> float:
    """(q, k) square map -> mean weight a query puts on itself."""
    return float(weights.diagonal(dim1=-2, dim2=-1).double().mean())


def top_key_agreement(a: Tensor, b: Tensor) -> float:
    """(q, k) x (q, k) -> fraction of queries whose argmax key is the same in both maps."""
    return float((a.argmax(-1) == b.argmax(-1)).double().mean())


def mean_entropy(weights: Tensor) -> float:
    """(..., q, k) -> mean row entropy in nats (float64), :func:`~agent_tools.analysis.metrics.attention_entropy`."""
    return float(attention_entropy(weights.double()).mean())


def self_copy_cosine(weights: Tensor, x: Tensor) -> float:
    """Mean cosine between each token's output ``(weights @ x)_i`` and its own input ``x_i`` (V = x)."""
    out = weights.double() @ x.double()  # (T, d_model)
    return float(torch.nn.functional.cosine_similarity(out, x.double(), dim=-1).mean())


def product_spectrum(a: Tensor, b: Tensor) -> Spectrum:
    """Spectrum of the low-rank product a·bᵀ for a (n, r), b (m, r) without forming the n×m matrix.

    With a = Q_a R_a and b = Q_b R_b (thin QR), a·bᵀ = Q_a (R_a R_bᵀ) Q_bᵀ has the singular values of R_a R_bᵀ.
    Used for a head's QK circuit W_Q W_Kᵀ and OV circuit W_V W_O.
    """
    _, r_a = torch.linalg.qr(a.double())  # (r, r)
    _, r_b = torch.linalg.qr(b.double())
    return matrix_spectrum(r_a @ r_b.T)
