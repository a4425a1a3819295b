"""Attribution patching and the numbers that size a patching effect, as pure functions.

Activation patching asks what the metric becomes when a component's clean output replaces its corrupted one;
attribution patching (Nanda 2023; Kramár et al. 2024, "AtP*") estimates that for every component from one
corrupted pass with a backward and one clean pass: the first-order change ``(z_clean − z_corrupted) · ∂M/∂z``,
with ``z`` the component's output and the gradient taken in the corrupted run. GradDrop (AtP*) repeats the backward
with the gradient through one layer's residual contribution dropped, L times, and scores a component by
``Σ_l |estimate_l| / (L − 1)``: where the direct and indirect paths of a component cancel in the plain estimate,
dropping one of them shows the size each has alone, so a cancelling component still ranks high enough to be
patched exactly.

The sizing helpers say whether an effect is large against patching the same number of random components
(:func:`effect_size` against their :class:`~agent_tools.analysis.metrics.Baseline`), whether a change of the top
token is a flip or a tie (:func:`top_token_change`), and whether a clean–corrupted gap is large enough to divide by
(:func:`minimum_gap`).

Tensors in, tensors or floats out; inputs are never modified. Shapes: ``T`` positions, ``H`` heads, ``D`` head
dims, ``L`` layers, ``C`` model width, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from agent_tools.analysis.ablation import TIE_MARGIN as TIE_MARGIN  # the one tie rule (patch_heads imports it here)
from agent_tools.analysis.attribution import spearman
from agent_tools.analysis.metrics import Baseline, allowed_from_additive_mask

LARGE_SPREADS = 3.0  # an effect is large when it is this many baseline spreads from the baseline mean ...
LARGE_FLOOR = 0.05  # ... and at least this far (5% of the clean–corrupted gap), so a zero-spread baseline
MIN_RELATIVE_GAP = 0.25  # a clean–corrupted gap below this × the clean logits' standard deviation is refused

EffectSize = Literal["large", "small"]
TokenChange = Literal["unchanged", "flip", "tie"]


def head_estimates(clean: Tensor, corrupted: Tensor, gradient: Tensor) -> Tensor:
    """(T, H, D) clean and corrupted head outputs and ∂M/∂z in the corrupted run -> (T, H) first-order effect of
    patching each head's clean output in at each position: Σ_D (z_clean − z_corrupted) · ∂M/∂z, in float32 (float64
    sums). A head's estimate over every position is the sum over T (the metric is linear in the first order)."""
    delta = clean.double() - corrupted.double()
    return (delta * gradient.double()).sum(-1)  # (T, H)


def output_estimates(clean: Tensor, corrupted: Tensor, gradient: Tensor) -> Tensor:
    """(T, C) clean and corrupted outputs of a module (a layer's attention or MLP) and ∂M/∂output -> the (T,)
    first-order effect of patching its clean output in at each position."""
    return ((clean.double() - corrupted.double()) * gradient.double()).sum(-1)


def grad_drop_scores(estimates: Tensor) -> Tensor:
    """(L, ...) estimates, each with the gradient through layer l's residual contribution dropped -> (...) the
    GradDrop score Σ_l |estimate_l| / (L − 1) (Kramár et al. 2024, eq. 11; L = 1: |estimate_0|)."""
    count = int(estimates.shape[0])
    return estimates.abs().sum(0) / max(1, count - 1)


def effect_size(value: float, reference: Baseline) -> EffectSize:
    """``large`` when |value − mean| exceeds both LARGE_SPREADS × the random draws' spread and LARGE_FLOOR
    (:func:`~agent_tools.analysis.metrics.chance_side` on either side)."""
    return "large" if reference.side(value, sds=LARGE_SPREADS, floor=LARGE_FLOOR) != 0 else "small"


@dataclass(frozen=True)
class TopTokenChange:
    """The top next token before and after an intervention, and whether the change is a flip or a tie."""

    before: int
    after: int
    kind: TokenChange
    p_before: float  # after the intervention: the probability of the token that was on top before
    p_after: float  # ... and of the token on top now


def top_token_change(before: Tensor, after: Tensor, *, margin: float = TIE_MARGIN) -> TopTokenChange:
    """(V,) logits before and after -> the top tokens and ``unchanged``, ``flip`` (the new top token leads the old
    one by at least ``margin`` in probability after the intervention) or ``tie`` (it leads by less)."""
    old, new = int(before.argmax()), int(after.argmax())
    probabilities = torch.softmax(after.double(), dim=-1)
    return top_token_read(old, new, float(probabilities[old]), float(probabilities[new]), margin=margin)


def top_token_read(old: int, new: int, p_old: float, p_new: float, *, margin: float = TIE_MARGIN) -> TopTokenChange:
    """:func:`top_token_change` from what a row kept (:mod:`agent_tools.runner.readout`): the top token before
    (``old``) and after (``new``) and, after the intervention, the probabilities of both."""
    if old == new:
        kind: TokenChange = "unchanged"
    else:
        kind = "flip" if p_new - p_old >= margin else "tie"
    return TopTokenChange(before=old, after=new, kind=kind, p_before=p_old, p_after=p_new)


def minimum_gap(clean_logits: Tensor, *, relative: float = MIN_RELATIVE_GAP) -> float:
    """(V,) the clean run's next-token logits -> the smallest clean–corrupted logit-difference gap worth dividing
    by: ``relative`` × the standard deviation of those logits (how far apart two ordinary tokens' logits are)."""
    return relative * float(clean_logits.double().std())


@dataclass(frozen=True)
class Verification:
    """Estimates against exact patching on the components that were patched exactly."""

    spearman: float | None  # rank agreement of estimate and exact value over every verified component
    recall: int  # of the exact top-k (among the verified), how many the estimate's top-k holds
    k: int
    missed: int | None  # index of the largest exact |effect| outside the estimate's top-k (None: none verified)


def verify(estimates: Sequence[float], exact: Sequence[float], top: Sequence[int], k: int) -> Verification:
    """``estimates`` and ``exact`` of the verified components (same order); ``top``: the indices (into them) of
    the estimate's top-k. Ranks by magnitude (a patch that pushes the other way matters as much)."""
    if len(estimates) != len(exact):
        raise ValueError("estimates and exact values must be paired")
    chosen = set(top)
    exact_top = sorted(range(len(exact)), key=lambda i: -abs(exact[i]))[:k]
    outside = [i for i in range(len(exact)) if i not in chosen]
    missed = max(outside, key=lambda i: abs(exact[i])) if outside else None
    rho = spearman([abs(v) for v in estimates], [abs(v) for v in exact])
    return Verification(spearman=rho, recall=len(chosen & set(exact_top)), k=k, missed=missed)


SATURATION_MASS = 0.1  # a head's softmax is saturated over a change when, on some query row, the pattern moves by at
SATURATION_MISSED = 0.5  # least this much attention mass (L1) and its first-order change misses more than this share


def _softmax_jvp(weights: Tensor, direction: Tensor) -> Tensor:
    """J_softmax(A)·v row by row: A ⊙ (v − Σ_k A_k v_k) (the same form gives Jᵀ·g, the Jacobian is symmetric)."""
    return weights * (direction - (weights * direction).sum(-1, keepdim=True))


def saturated_heads(
    scores: Tensor, target: Tensor, *, mass: float = SATURATION_MASS, missed: float = SATURATION_MISSED
) -> Tensor:
    """(H, T, K) float32 masked scores of the corrupted run and of the clean run -> (H,) bool: the heads with a
    query row whose exact pattern change ΔA = softmax(s') − softmax(s) moves at least ``mass`` of attention (L1)
    while the first-order change J(A)·Δs misses more than ``missed`` of it (‖ΔA − J(A)·Δs‖₁ > missed·‖ΔA‖₁): the
    softmax's gradient says little about patching its inputs there. Masked keys carry no weight in either run."""
    weights, patched = torch.softmax(scores, -1), torch.softmax(target, -1)
    change = torch.where(allowed_from_additive_mask(scores), target - scores, torch.zeros_like(scores))
    moved = (patched - weights).abs().sum(-1)  # (H, T)
    error = (patched - weights - _softmax_jvp(weights, change)).abs().sum(-1)  # (H, T)
    return ((moved >= mass) & (error > missed * moved)).any(-1)


def corrected_score_gradient(scores: Tensor, target: Tensor, gradient: Tensor, heads: Tensor) -> Tensor:
    """AtP*'s fix for saturated attention (Kramár et al. 2024, §3.1.1), as the gradient at the scores.

    (B, H, T, K) scores s of the corrupted run, (1 or B, H, T, K) scores s' with the clean run's queries and keys,
    (B, H, T, K) ∂M/∂A at the pattern A = softmax(s), (H,) bool heads to correct -> (B, H, T, K) ∂M/∂s.

    The plain gradient is J(A)ᵀ·g; on a saturated row it is ~0 although moving the scores from s to s' flips the
    pattern. For the corrected heads the row's gradient becomes J(A)ᵀ·g + r·c/‖c‖², where c is Δs = s' − s centred
    over the row's allowed keys (a constant shift changes no softmax) and r = g·(softmax(s') − softmax(s)) − (J(A)ᵀ·g)·c
    is what the first order misses. Then the gradient times the whole change Δs is exactly g·ΔA, the linear estimate
    through the recomputed pattern; a component that moves the scores by part of Δs gets the share of r its score
    change has along c (a change orthogonal to c, or a constant shift, gets the plain gradient)."""
    weights = torch.softmax(scores, -1)
    local = _softmax_jvp(weights, gradient)
    allowed = allowed_from_additive_mask(scores)
    change = torch.where(allowed, target - scores, torch.zeros_like(scores))
    count = allowed.sum(-1, keepdim=True).clamp(min=1)
    centred = torch.where(allowed, change - change.sum(-1, keepdim=True) / count, torch.zeros_like(change))
    exact = (gradient * (torch.softmax(target, -1) - weights)).sum(-1, keepdim=True)
    missing = exact - (local * centred).sum(-1, keepdim=True)
    norm = (centred * centred).sum(-1, keepdim=True)
    fix = torch.where(norm > 1e-12, missing / norm.clamp(min=1e-12), torch.zeros_like(norm)) * centred
    return torch.where(heads.reshape(1, -1, 1, 1), local + fix, local)


class SaturationCorrectedSoftmax(torch.autograd.Function):
    """softmax(scores) forward; :func:`corrected_score_gradient` backward for the chosen heads (plain elsewhere).
    Inputs: (B, H, T, K) float32 scores, (1 or B, H, T, K) clean-run scores, (H,) bool heads."""

    @staticmethod
    def forward(ctx, scores: Tensor, target: Tensor, heads: Tensor) -> Tensor:
        ctx.save_for_backward(scores, target, heads)
        return torch.softmax(scores, -1)

    @staticmethod
    def backward(ctx, gradient: Tensor) -> tuple[Tensor, None, None]:
        scores, target, heads = ctx.saved_tensors
        return corrected_score_gradient(scores, target, gradient, heads), None, None
