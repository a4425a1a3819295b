"""Attention rebuilt step by step from the layer's input: dot product, scale, projections, positions, mask.

Pure tensor functions. ``x`` is the (T, d_model) hidden state entering the attention module (the normalised
input for pre-norm families). The five stages follow the recipe "start with a plain dot product and add the
pieces one by one"; the last one is exactly transformers' eager attention and must equal the model's map.

What each stage divides the dot products by (``StageMap.divisor`` = 1 / ``StageMap.scale``):

1. ``x·xᵀ``: nothing (÷ 1);
2. ``x·xᵀ / sqrt(d_k)``: the textbook factor, d_k = the head's dimension (``w_q``'s columns), *not* the width of
   ``x`` — so stage 2 is attention with no projections and the scale every head uses;
3. to 5. ``q·kᵀ`` times the model's own factor (``scaling · query_prescale``), which is 1/sqrt(d_k) for the
   standard scale: where a family uses another (Gemma's ``query_pre_attn_scalar``), stage 3 says so.

Families that add a term to the scores get one more stage before the model's: ``score_terms``, the positional
scores plus that term (T5's relative position bias, ALiBi, DeBERTa's c2p/p2c), as the capture recorded it. A
family with learned sink logits (GPT-OSS) has them in the last stage: the softmax runs over the keys and one more
column holding the head's sink logit, so the real keys' weights sum to 1 − the sink's share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from agent_tools.analysis.metrics import (
    allowed_from_additive_mask,
    attention_entropy,
    masked_softmax,
    normalised_from_entropy,
    visible_keys,
)
from agent_tools.capture import soft_capped
from agent_tools.layout import apply_rotary

# The stages in order; "score_terms" only where the family adds a term to the scores.
ReconstructionStage = Literal[
    "raw_dot_product", "scaled_dot_product", "projected", "positional", "score_terms", "model"
]


@dataclass(frozen=True)
class StageMap:
    """One stage's logits (what goes into the softmax) and weights, (T, T) each."""

    stage: ReconstructionStage
    scores: Tensor  # (T, T) scaled dot products before mask (and before soft-capping)
    logits: Tensor  # (T, T) what enters the softmax: scores (+ mask where this stage applies it)
    weights: Tensor  # (T, T) softmax of the logits
    allowed: Tensor  # (T, T) bool: keys this stage lets a query read
    scale: float  # the factor the dot products were multiplied by

    @property
    def divisor(self) -> float:
        """What the dot products are divided by at this stage (1 / ``scale``): 1, then sqrt(d_k)."""
        return 1.0 / self.scale


def project_queries_keys(
    x: Tensor,
    *,
    w_q: Tensor,
    w_k: Tensor,
    b_q: Tensor | None = None,
    b_k: Tensor | None = None,
    query_prescale: float = 1.0,
    rotary: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """(T, d_model) input -> the head's (q, k), each (T, d_head): ``x W + b``, the query prescaled, then RoPE.

    These are the vectors whose dot product, times the model's scale, is the head's score (stage 4).
    """
    x32 = x.float()
    q = (x32 @ w_q.float() + (b_q.float() if b_q is not None else 0.0)) * query_prescale  # (T, d_head)
    k = x32 @ w_k.float() + (b_k.float() if b_k is not None else 0.0)  # (T, d_head)
    return _rotated(q, k, rotary)


def _rotated(q: Tensor, k: Tensor, rotary: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """RoPE applied to (T, d_head) q and k with (cos, sin) each (T, d_rot); unchanged without rotary."""
    if rotary is None:
        return q, k
    cos, sin = rotary
    return apply_rotary(q, cos.float(), sin.float()), apply_rotary(k, cos.float(), sin.float())


def reconstruction_stages(
    x: Tensor,
    *,
    w_q: Tensor,
    w_k: Tensor,
    scaling: float,
    b_q: Tensor | None = None,
    b_k: Tensor | None = None,
    query_prescale: float = 1.0,
    rotary: tuple[Tensor, Tensor] | None = None,
    mask: Tensor | None = None,
    softcap: float | None = None,
    mask_every_stage: bool = False,
    bias: Tensor | None = None,
    sink: float | None = None,
) -> list[StageMap]:
    """The five stages for one head (six with ``bias``).

    Args:
        x: (T, d_model) input of the attention module.
        w_q, w_k: (d_model, d_head) the head's query and key projections (``q = x @ w_q + b_q``).
        scaling: the factor the attention function multiplies q·kᵀ by (the model's own).
        b_q, b_k: (d_head,) biases where the family has them.
        query_prescale: a factor the family folds into the query projection (OPT), 1.0 elsewhere.
        rotary: (cos, sin), each (T, d_rot), for RoPE families; None where positions are already in ``x``.
        mask: (T, T) additive mask (0 = may read, very negative = may not); None = every key.
        softcap: logit soft-capping c (scores = c·tanh(scores / c)) where the family uses it.
        mask_every_stage: also apply the mask to stages 1–4 (isolates the other pieces on causal models).
        bias: (T, T) the additive score term the family adds after soft-capping (T5's relative position bias,
            ALiBi, c2p/p2c); it gets its own ``score_terms`` stage.
        sink: the head's learned sink logit (GPT-OSS): an extra softmax column in the last stage.

    Stages: (1) x·xᵀ; (2) x·xᵀ / sqrt(d_k), d_k = ``w_q``'s columns (the head's dimension); (3)
    (x W_Q + b_Q)(x W_K + b_K)ᵀ · scale, before positions; (4) the same after RoPE (= stage 3 where positions are
    added to x); (5) soft-capped, masked, softmaxed: the model's attention.
    """
    x32 = x.float()
    length = x32.shape[0]
    every = torch.ones(length, length, dtype=torch.bool, device=x.device)
    allowed = every if mask is None else allowed_from_additive_mask(mask)
    early_mask = mask if mask_every_stage else None
    early_allowed = allowed if mask_every_stage else every

    def stage(name: ReconstructionStage, scores: Tensor, scale: float) -> StageMap:
        logits = scores + early_mask if early_mask is not None else scores
        weights = masked_softmax(scores.float(), allowed if early_mask is not None else None)
        return StageMap(name, scores, logits, weights, early_allowed, scale)

    raw = x32 @ x32.T  # (T, T)
    head_scale = 1 / math.sqrt(w_q.shape[-1])  # 1/sqrt(d_k)
    effective = scaling * query_prescale
    q, k = project_queries_keys(x32, w_q=w_q, w_k=w_k, b_q=b_q, b_k=b_k, query_prescale=query_prescale)
    projected = (q @ k.T) * scaling  # (T, T) before positions
    q, k = _rotated(q, k, rotary)  # (T, d_head) each
    positional = (q @ k.T) * scaling  # (T, T)
    termed = positional + bias.float() if bias is not None else positional  # (T, T) before mask and soft-cap
    capped = soft_capped(positional, softcap)
    capped = capped + bias.float() if bias is not None else capped
    model_allowed = allowed if mask is not None else None
    if sink is None:
        final = masked_softmax(capped.float(), model_allowed)
    else:
        final = sink_softmax(capped.float(), model_allowed, sink)
    final_logits = capped + mask if mask is not None else capped
    stages = [
        stage("raw_dot_product", raw, 1.0),
        stage("scaled_dot_product", raw * head_scale, head_scale),
        stage("projected", projected, effective),
        stage("positional", positional, effective),
    ]
    if bias is not None:
        stages.append(stage("score_terms", termed, effective))
    stages.append(StageMap("model", termed, final_logits, final, allowed, effective))
    return stages


def sink_softmax(logits: Tensor, allowed: Tensor | None, sink: float) -> Tensor:
    """(T, T) softmax over the allowed keys *and* one more column holding ``sink``, the sink column dropped.

    GPT-OSS's eager attention: ``softmax(cat([logits, sink]))[..., :-1]``. Rows sum to 1 − the sink column's
    share (the glossary's "sink column share"); keys that may not be read get exactly 0.
    """
    column = torch.full((*logits.shape[:-1], 1), float(sink), dtype=logits.dtype, device=logits.device)
    hidden = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    return torch.softmax(torch.cat([hidden, column], dim=-1), dim=-1)[..., :-1]


def positional_scores(stages: list[StageMap], softcap: float | None = None, bias: Tensor | None = None) -> Tensor:
    """Stage 4's scores soft-capped (plus the family's additive term) like the model's captured pre-mask scores
    (for parity checks)."""
    capped = soft_capped(next(s for s in stages if s.stage == "positional").scores, softcap)
    return capped + bias.float() if bias is not None else capped


@dataclass(frozen=True)
class StageMeasures:
    mean_entropy: float  # nats
    mean_normalised_entropy: float  # entropy / log(keys visible)
    mean_max_weight: float
    self_share: float  # mean weight on the query itself
    logit_std: float  # mean over queries of the std of the logits over the keys it may read
    top_key: Tensor  # (T,) argmax key per query
    top_weight: Tensor  # (T,)


def stage_measures(stage: StageMap) -> StageMeasures:
    """Entropy, concentration, self-share and logit spread of one stage's map."""
    weights = stage.weights.double()
    allowed = stage.allowed
    hidden = ~allowed
    entropy = attention_entropy(weights)  # (T,)
    normalised = normalised_from_entropy(entropy, visible_keys(allowed).double())  # (T,) the same entropy, once
    top_weight, top_key = weights.max(-1)
    logits = stage.logits.to(torch.float64, copy=True).masked_fill_(hidden, 0.0)  # (T, T) a copy: input untouched
    count = allowed.sum(-1).clamp_min(1).double()  # (T,)
    mean = logits.sum(-1) / count
    variance = (logits - mean[:, None]).masked_fill_(hidden, 0.0).square_().sum(-1) / count  # two-pass: exact
    return StageMeasures(
        mean_entropy=float(entropy.mean()),
        mean_normalised_entropy=float(normalised.mean()),
        mean_max_weight=float(top_weight.mean()),
        self_share=float(weights.diagonal().mean()),
        logit_std=float(variance.sqrt().mean()),
        top_key=top_key,
        top_weight=top_weight,
    )
