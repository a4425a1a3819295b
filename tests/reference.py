"""The references captured attention must match, and the tolerances: shared by the parity tests."""

from __future__ import annotations

from typing import Any

import torch

from agent_tools.analysis.collapse import HeadCollapse
from agent_tools.analysis.metrics import SATURATION
from agent_tools.capture import LayerAttention, attention_implementation
from agent_tools.consumers.collapse import HeadAccumulator

ATOL = 1e-5
SAMPLE_TEXT = "The cat sat on the mat because it was tired, and the dog watched it from the door."


def eager_reference(model: torch.nn.Module, **inputs: torch.Tensor) -> Any:
    """The model's own eager forward with output_attentions (the reference we must match)."""
    with attention_implementation(model, "eager"), torch.inference_mode():
        return model(**inputs, output_attentions=True)


def output_tensor(output: Any) -> torch.Tensor:
    """The logits of a language model, else the last hidden states."""
    return output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state


class KeepAll:
    """A consumer that keeps every captured layer and every chunk's weights (tests only: it holds the maps)."""

    accepts_key_prefix = False

    def __init__(self) -> None:
        self.layers: dict[int, LayerAttention] = {}
        self.rows: dict[int, list[torch.Tensor]] = {}

    def on_layer(self, layer: LayerAttention) -> None:
        self.layers[layer.layer] = layer
        self.rows.setdefault(layer.layer, []).append(layer.weights.clone())

    def weights(self, layer: int) -> torch.Tensor:
        return torch.cat(self.rows[layer], dim=2)


def rebuild(layer: LayerAttention) -> torch.Tensor:
    """softmax(q·kᵀ·scale (soft-capped) + mask) from the captured q and k alone."""
    scores = layer.query @ layer.head_key(layer.key).transpose(-1, -2) * layer.scaling
    if layer.softcap:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if layer.mask is not None:
        scores = scores + layer.mask
    return torch.softmax(scores.float(), dim=-1)


def collapse_statistics(
    weights: torch.Tensor,
    scores: torch.Tensor,
    allowed: torch.Tensor,
    sink_mask: torch.Tensor,
    *,
    layer: int = 0,
    threshold: float = SATURATION,
    value_norms: torch.Tensor | None = None,
) -> list[HeadCollapse]:
    """diagnose_collapse's per-head statistics on whole maps, through the consumer's :class:`HeadAccumulator`:
    weights/scores (h, q, k) with query i at key column i, allowed (q, k)."""
    accumulator = HeadAccumulator(layer, range(weights.shape[0]), weights.shape[-1], threshold=threshold)
    positions = torch.arange(weights.shape[-1] - weights.shape[-2], weights.shape[-1], device=weights.device)
    accumulator.add(weights, scores, allowed, positions, sink_mask, value_norms=value_norms)
    return accumulator.finish(sink_mask)
