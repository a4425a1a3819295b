"""Interventions on a model's forward: remove chosen heads' contribution, record per-head outputs.

A head's contribution to the residual stream is its slice of the attention output before the output projection
(``o_proj`` in Llama-like families, ``out_proj`` in OPT, ``c_proj`` in GPT-2, ``dense`` in GPT-NeoX, the sibling
``output.dense`` in BERT-like encoders): head ``h`` owns input features ``h·D .. (h+1)·D − 1``. We change that
input with a forward pre-hook, registered only inside a context manager and removed in ``finally``, so the model
is exactly as it was afterwards. No attention weights are needed: the model keeps its own implementation (sdpa).
The projection's bias is shared by all heads and is kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Literal, get_args

from torch import Tensor, nn

from agent_tools.analysis.ablation import masked_mean, replace_head_slices
from agent_tools.errors import UnsupportedModelError
from agent_tools.families import find_attention_modules

AblationMethod = Literal["zero", "mean"]
ABLATION_METHODS: tuple[AblationMethod, ...] = get_args(AblationMethod)

OUTPUT_PROJECTION_NAMES = ("o_proj", "out_proj", "c_proj", "dense")


def _in_features(module: nn.Module) -> int | None:
    if isinstance(module, nn.Linear):
        return module.in_features
    weight = getattr(module, "weight", None)
    if weight is not None and type(module).__name__ == "Conv1D":  # GPT-2 stores (in, out)
        return int(weight.shape[0])
    return None


def output_projection(model: nn.Module, layer: int) -> nn.Module:
    """The module that maps layer ``layer``'s concatenated head outputs (…, H·D) into the residual stream."""
    attention = find_attention_modules(model)[layer]
    for name in OUTPUT_PROJECTION_NAMES:
        child = getattr(attention, name, None)
        if isinstance(child, nn.Module) and _in_features(child) is not None:
            return child
    path = next((name for name, module in model.named_modules() if module is attention), "")
    parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
    dense = getattr(getattr(parent, "output", None), "dense", None)
    if isinstance(dense, nn.Module) and _in_features(dense) is not None:
        return dense
    msg = f"cannot find the output projection of layer {layer} ({type(attention).__name__}); ablation needs it"
    raise UnsupportedModelError(msg)


def _projections(model: nn.Module, layers: Sequence[int], width: int) -> dict[int, nn.Module]:
    found = {}
    for layer in layers:
        projection = output_projection(model, layer)
        if _in_features(projection) != width:
            msg = (
                f"layer {layer}'s output projection takes {_in_features(projection)} features, not heads × head_dim "
                f"= {width}; per-head ablation would be wrong, so it is refused"
            )
            raise UnsupportedModelError(msg)
        found[layer] = projection
    return found


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
        model: any family :func:`output_projection` finds.
        heads: layer -> query heads to ablate.
        num_heads, head_dim: the layer's query heads and dims per head (the projection takes H·D features).
        method: ``zero`` replaces the heads' outputs by 0; ``mean`` by ``means[layer]`` (H, D).
        means: per-layer mean head outputs for ``method="mean"`` (see :func:`recorded_head_means`).
    """
    if method not in ABLATION_METHODS:
        raise ValueError(f"method must be one of {ABLATION_METHODS}, got {method!r}")
    if method == "mean" and (means is None or any(layer not in means for layer in heads)):
        raise ValueError("mean ablation needs the mean head outputs of every ablated layer")
    projections = _projections(model, [layer for layer, chosen in heads.items() if chosen], num_heads * head_dim)
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
    projections = _projections(model, layers, num_heads * head_dim)
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
