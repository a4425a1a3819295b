"""Interventions on a model's forward: remove chosen heads' contribution, record per-head outputs.

A head's contribution to the residual stream is its slice of the attention output before the output projection
(found for every family by :func:`agent_tools.layout.output_projection`): head ``h`` owns input features
``h·D .. (h+1)·D − 1``. We change that input with a forward pre-hook, registered only inside a context manager
and removed in ``finally``, so the model is exactly as it was afterwards. No attention weights are needed: the
model keeps its own implementation (sdpa). The projection's bias is shared by all heads and is kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Literal, get_args

from torch import Tensor, nn

from agent_tools.analysis.ablation import masked_mean, replace_head_slices
from agent_tools.layout import output_projection

AblationMethod = Literal["zero", "mean"]
ABLATION_METHODS: tuple[AblationMethod, ...] = get_args(AblationMethod)


@contextmanager
def heads_ablated(
    model: nn.Module,
    heads: Mapping[int, Sequence[int]],
    *,
    num_heads: int,
    head_dim: int,
    method: AblationMethod = "zero",
    means: Mapping[int, Tensor] | None = None,
) -> Iterator[None]:
    """Inside the block, the named heads (layer -> heads) write zero (or their mean output) into the projection.

    Args:
        model: any family :func:`agent_tools.layout.output_projection` finds.
        heads: layer -> query heads to ablate.
        num_heads, head_dim: the layer's query heads and dims per head (the projection takes H·D features).
        method: ``zero`` replaces the heads' outputs by 0; ``mean`` by ``means[layer]`` (H, D).
        means: per-layer mean head outputs for ``method="mean"`` (see :func:`recorded_head_means`).
    """
    if method not in ABLATION_METHODS:
        raise ValueError(f"method must be one of {ABLATION_METHODS}, got {method!r}")
    if method == "mean" and (means is None or any(layer not in means for layer in heads)):
        raise ValueError("mean ablation needs the mean head outputs of every ablated layer")
    width = num_heads * head_dim
    projections = {
        layer: output_projection(model, layer, in_features=width) for layer, chosen in heads.items() if chosen
    }
    handles = []

    def hook_for(layer: int):
        chosen = list(heads[layer])
        layer_means = means[layer] if method == "mean" and means is not None else None

        def hook(module: nn.Module, args: tuple) -> tuple:
            return (replace_head_slices(args[0], chosen, head_dim, layer_means), *args[1:])

        return hook

    try:
        for layer, projection in projections.items():
            handles.append(projection.register_forward_pre_hook(hook_for(layer)))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def recorded_head_means(
    model: nn.Module,
    layers: Sequence[int],
    *,
    num_heads: int,
    head_dim: int,
    attention_mask: Tensor | None = None,
) -> Iterator[dict[int, Tensor]]:
    """Inside the block, each forward records every head's mean output (H, D) per layer, over unmasked positions.

    The dict yielded is filled by the forward run inside the block (the last forward wins).
    """
    projections = {layer: output_projection(model, layer, in_features=num_heads * head_dim) for layer in layers}
    means: dict[int, Tensor] = {}
    handles = []

    def hook_for(layer: int):
        def hook(module: nn.Module, args: tuple) -> None:
            hidden = args[0]  # (B, T, H·D)
            mask = attention_mask if attention_mask is not None and attention_mask.shape == hidden.shape[:2] else None
            means[layer] = masked_mean(hidden, mask).reshape(num_heads, head_dim).detach().clone()  # (H, D)

        return hook

    try:
        for layer, projection in projections.items():
            handles.append(projection.register_forward_pre_hook(hook_for(layer)))
        yield means
    finally:
        for handle in handles:
            handle.remove()


def group_heads(heads: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
    """[(layer, head), ...] -> {layer: [heads]} in layer order."""
    grouped: dict[int, list[int]] = {}
    for layer, head in heads:
        grouped.setdefault(layer, []).append(head)
    return dict(sorted(grouped.items()))
