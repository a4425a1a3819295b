"""Head-ablated forward passes: the clean run and the run with the named heads' outputs removed, one set at a time
or many sets as the rows of one batch."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_tools.intervene import (
    AblationMethod,
    group_heads,
    heads_ablated,
    heads_patched_joining,
    recorded_head_means,
)
from agent_tools.loading import LoadedModel
from agent_tools.runner import patching
from agent_tools.runner.forward import _mask_on_device, encoder_of, model_output, on_device


@dataclass(frozen=True)
class AblationEffect:
    """Clean vs ablated outputs of one input, as tensors for the service layer (never returned by a tool)."""

    clean: Tensor  # (B, T, V) logits or (B, T, C) hidden states
    ablated: Tensor
    language_model: bool


def ablated_forward(
    loaded: LoadedModel,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    heads: Sequence[tuple[int, int]],
    *,
    method: AblationMethod = "zero",
    clean: Tensor | None = None,
    resample_ids: Tensor | None = None,
) -> AblationEffect:
    """Clean (unless given) and ablated forwards with the model's own attention implementation, under its lock.

    ``resample_ids`` (1, T), another input of the same length, is what ``method="resample"`` copies the heads'
    outputs from. On an encoder–decoder the heads are the encoder stack's and the passes run the encoder alone:
    the effect is measured on the encoder's output (hidden states), as for an encoder-only model.
    """
    facts = loaded.facts
    input_ids, attention_mask = on_device(loaded, input_ids), _mask_on_device(loaded, attention_mask)
    grouped = group_heads(heads)
    model = loaded.model  # the hooks go on its (default-stack) attention modules
    run = encoder_of(loaded) if facts.is_encoder_decoder else model
    if method == "resample" and (resample_ids is None or resample_ids.shape != input_ids.shape):
        raise ValueError("resample ablation needs resample_ids of the input's shape")
    with loaded.lock, torch.inference_mode():
        means = None
        if clean is None or method == "mean":
            with recorded_head_means(
                model,
                list(grouped) if method == "mean" else [],
                num_heads=facts.num_heads,
                head_dim=facts.head_dim,
                attention_mask=attention_mask,
            ) as recorded:
                clean_out, is_lm = model_output(run(input_ids=input_ids, attention_mask=attention_mask))
            clean = clean if clean is not None else clean_out
            means = dict(recorded)
        if method == "resample" and resample_ids is not None:
            means = head_outputs(loaded, resample_ids, list(grouped))
        with heads_ablated(
            model, grouped, num_heads=facts.num_heads, head_dim=facts.head_dim, method=method, means=means
        ):
            ablated, is_lm = model_output(run(input_ids=input_ids, attention_mask=attention_mask))
    return AblationEffect(clean=clean, ablated=ablated, language_model=is_lm)


def head_outputs(loaded: LoadedModel, input_ids: Tensor, layers: Sequence[int]) -> dict[int, Tensor]:
    """Layer -> (T, H, D) every head's output before W_O on a (1, T) input: what mean ablation averages over
    positions and what resample ablation copies from another text (the heads' inputs are what the pass reads: no
    (T, vocabulary) logits)."""
    return patching.recorded_run(loaded, input_ids, layers=layers).heads


@dataclass(frozen=True)
class HeadSetAblation:
    """One row of an ablation batch: these heads (any layers) replaced by one method."""

    heads: tuple[tuple[int, int], ...]
    method: AblationMethod


def mean_head_outputs(loaded: LoadedModel, input_ids: Tensor, layers: Sequence[int]) -> dict[int, Tensor]:
    """Layer -> (H, D) each head's output before W_O averaged over the positions of (1, T) ``input_ids`` (summed in
    float64, kept in the model's dtype): what mean ablation puts in a head's place."""
    outputs = head_outputs(loaded, input_ids, layers)
    return {layer: value.double().mean(0).to(value.dtype) for layer, value in outputs.items()}


Reduce = Callable[[Tensor], tuple[Tensor, ...]]


def _by_method(
    masks: Mapping[int, Tensor],
    methods: Sequence[AblationMethod],
    replacements: Mapping[AblationMethod, Mapping[int, Tensor]],
) -> dict[int, list[tuple[Tensor, Tensor | None]]]:
    """:func:`~agent_tools.runner.patching.set_masks`' (R_l, 1, H) masks, row ``r + 1`` ablated by ``methods[r]``
    -> :func:`~agent_tools.intervene.heads_patched_joining`'s (mask, what replaces it) pairs, one per method."""
    replaced: dict[int, list[tuple[Tensor, Tensor | None]]] = {}
    for layer, mask in masks.items():
        for method in dict.fromkeys(methods):
            rows = torch.tensor([False] + [m == method for m in methods])[: mask.shape[0], None, None]  # (R_l, 1, 1)
            if bool((mask & rows).any()):
                source = replacements[method][layer] if method != "zero" else None
                replaced.setdefault(layer, []).append((mask & rows, source))
    return replaced


def ablated_rows(
    loaded: LoadedModel,
    input_ids: Tensor,
    rows: Sequence[HeadSetAblation],
    *,
    replacements: Mapping[AblationMethod, Mapping[int, Tensor]],
    reduce: Reduce,
    max_rows: int = patching.BATCH_ROWS,
    logits_to_keep: int | None = None,
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """(1, T) ids and R head sets -> what ``reduce`` keeps of the clean output and of each ablated row's.

    With ``logits_to_keep`` (language models) ``reduce`` gets the last that many positions' logits only, (B, K, V).

    ``reduce`` gets a batch's (B, T, V) logits (or (B, T, C) hidden states), row 0 unablated, and returns tensors
    with B rows (e.g. per-position losses): only those are kept, so a batch's full output never outlives it. Rows
    are sorted by their first ablated layer and sent in batches of at most ``max_rows``; each joins its batch at
    that layer (:func:`agent_tools.intervene.heads_patched_joining`). Returns (clean row's tensors, each
    tensor stacked over the R rows in the order given).
    """
    facts = loaded.facts
    ids = on_device(loaded, input_ids)
    order = sorted(range(len(rows)), key=lambda i: min(layer for layer, _ in rows[i].heads))
    kept: dict[int, tuple[Tensor, ...]] = {}
    clean: tuple[Tensor, ...] = ()

    def run() -> Tensor:  # (B, K or T, V) logits or (B, T, C) hidden states
        return model_output(patching.encoder_or_model(loaded, ids, use_cache=False, logits_to_keep=logits_to_keep))[0]

    with loaded.lock, torch.inference_mode():
        if not rows:
            return tuple(t[0] for t in reduce(run())), ()
        for start in range(0, len(order), max(1, max_rows)):
            group = order[start : start + max(1, max_rows)]
            batch = [patching.HeadPatch.together(rows[i].heads) for i in group]
            masks, joining = patching.set_masks(batch, int(ids.shape[-1]), facts.num_heads)  # (R_l, 1, H) masks
            replaced = _by_method(masks, [rows[i].method for i in group], replacements)
            with heads_patched_joining(
                loaded.model, replaced, joining, num_heads=facts.num_heads, head_dim=facts.head_dim
            ):
                reduced = reduce(run())
            clean = clean or tuple(t[0] for t in reduced)
            for row, index in enumerate(group, start=1):
                kept[index] = tuple(t[row] for t in reduced)
    stacked = tuple(torch.stack([kept[i][k] for i in range(len(rows))]) for k in range(len(kept[0])))
    return clean, stacked
