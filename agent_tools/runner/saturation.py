"""AtP*'s fix for saturated attention inside attribution patching's two passes (Kramár et al. 2024, §3.1.1).

An attention function registered in transformers' ``AttentionInterface`` computes the families' eager math in
float32 (GQA, soft-capping, additive score terms, sink logits, as :mod:`agent_tools.capture` does) and, inside
:func:`saturation_corrected`, either records every layer's masked scores (the clean pass: its queries and keys)
or, in the corrupted pass, finds the heads whose softmax is saturated over the clean–corrupted change
(:func:`agent_tools.analysis.attribution_patching.saturated_heads`) and gives their softmax the corrected backward
(:class:`~agent_tools.analysis.attribution_patching.SaturationCorrectedSoftmax`): the pattern recomputed exactly
with the clean queries and keys, the linear estimate taken through that pattern change. Every component upstream
of such a head (the heads that write its queries or keys) is then credited through the recomputed pattern instead
of the ~0 gradient of the saturated softmax. The forward values are the plain eager ones either way.

Families that an :mod:`agent_tools.adapters` adapter routes (BLOOM, MPT, Falcon, DeBERTa-v2) do not call this
function; their layers keep the plain gradient (none is listed as corrected).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.modeling_utils import AttentionInterface

from agent_tools.analysis.attribution_patching import SaturationCorrectedSoftmax, saturated_heads
from agent_tools.capture import (
    _additive_mask,
    _score_terms,
    attention_implementation,
    attention_scale,
    attention_scores,
    repeat_kv,
)
from agent_tools.families import SELF, attention_stacks

SATURATION_IMPLEMENTATION = "attention_explainer_saturation"


@dataclass
class SaturationState:
    """What the two passes share: each layer's clean scores, and the heads the corrupted pass corrected."""

    layers: dict[int, int]  # id(attention module) -> layer
    record: bool = True  # True: the clean pass (record scores); False: the corrupted pass (correct)
    clean: dict[int, Tensor] = field(default_factory=dict)  # layer -> (1, H, T, K) float32 masked scores
    corrected: dict[int, list[int]] = field(default_factory=dict)  # layer -> saturated heads


_ACTIVE: contextvars.ContextVar[SaturationState | None] = contextvars.ContextVar("saturation", default=None)


def saturation_state(model: nn.Module) -> SaturationState:
    """A fresh state knowing the model's self-attention modules by layer."""
    modules = attention_stacks(model).get(SELF, [])
    return SaturationState(layers={id(module): layer for layer, module in enumerate(modules)})


@contextmanager
def saturation_corrected(model: nn.Module, state: SaturationState, *, record: bool) -> Iterator[SaturationState]:
    """Inside the block the model runs :func:`saturation_attention_forward` with ``state`` (recording the clean
    scores when ``record``, correcting saturated heads otherwise); the implementation is restored in ``finally``."""
    state.record = record
    with attention_implementation(model, SATURATION_IMPLEMENTATION, active=(_ACTIVE, state)):
        yield state


def saturation_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Eager attention, softmax in float32; scores recorded or saturated heads corrected per the active state."""
    terms = _score_terms(module, query, kwargs)
    scaling = attention_scale(module, query, scaling)
    groups = query.shape[1] // key.shape[1]
    keys, values = repeat_kv(key, groups), repeat_kv(value, groups)  # (B, H, K, D)
    width = keys.shape[-2]
    scores = attention_scores(query.float(), keys.float(), float(scaling), kwargs.get("softcap"))  # (B, H, T, K)
    bias = terms.rows(0, query.shape[2], width)
    if bias is not None:
        scores = scores + bias.float()
    mask = _additive_mask(attention_mask, torch.float32, width)
    if mask is not None:
        scores = scores + mask.float()
    if terms.sinks is not None:  # GPT-OSS: one more softmax column holding the head's sink logit
        column = terms.sinks.reshape(1, -1, 1, 1).float().expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
    state = _ACTIVE.get()
    layer = state.layers.get(id(module)) if state is not None else None
    target = state.clean.get(layer) if state is not None and layer is not None and not state.record else None
    if state is not None and layer is not None and state.record:
        state.clean[layer] = scores[:1].detach()
    if state is not None and layer is not None and target is not None and target.shape == scores[:1].shape:
        heads = saturated_heads(scores[0].detach(), target[0])
        state.corrected[layer] = heads.nonzero().flatten().tolist()
        weights = SaturationCorrectedSoftmax.apply(scores, target, heads) if bool(heads.any()) else None
    else:
        weights = None
    if weights is None:
        weights = torch.softmax(scores, dim=-1)
    if terms.sinks is not None:
        weights = weights[..., :-1]
    output = torch.matmul(weights.to(value.dtype), values)  # (B, H, T, D)
    return output.transpose(1, 2).contiguous(), weights


AttentionInterface.register(SATURATION_IMPLEMENTATION, saturation_attention_forward)
AttentionMaskInterface.register(SATURATION_IMPLEMENTATION, eager_mask)
