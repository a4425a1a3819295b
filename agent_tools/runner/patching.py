"""Patched forward passes: many variants of one sequence, each with some heads' outputs replaced, in batches.

Activation patching (``patch_heads``) and single-head ablation evidence (``profile_heads``) both ask "what does
the output become when head h's output is replaced?" for hundreds of heads. One forward per head would cost
``L·H`` full passes; here a variant is a *row* of a batch (see :func:`agent_tools.intervene.heads_patched_joining`):
rows are sorted by the layer they patch, and a row joins the batch at that layer (as a copy of the unpatched row
0), so a row patching layer ``l`` runs the layers ``l..L-1`` only and every layer's matrix products take all the
rows alive there at once. Positions before the first one
where the two prompts differ run once, as a KV cache every batch reuses (patches there change nothing). Every
pass uses the model's own attention implementation, holds the model's lock and runs under ``inference_mode``;
the caller (the inspector) adds the call's checkpoint.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_tools.families import output_head
from agent_tools.intervene import contiguous_input, group_heads, heads_patched_joining, recorded_head_inputs
from agent_tools.loading import LoadedModel
from agent_tools.runner.forward import encoder_of, model_output, on_device
from agent_tools.runner.generation import _cache_argument, cache_layers, cache_of
from agent_tools.runner.paths import default_implementation
from agent_tools.runner.readout import Readout, stacked

BATCH_ROWS = 64  # patched (or ablated) rows per forward at most (see the module docstring for why)
ROW_ACTIVATION_FLOATS = 24  # floats held per row, position and model width while a patched batch runs (estimate)


@dataclass(frozen=True)
class HeadPatch:
    """One variant: in ``layer``, replace ``heads`` at ``positions`` (None: every position); ``also``: more
    (layer, head) pairs of ``layer`` or later layers replaced in the same row (a set of heads patched together)."""

    layer: int
    heads: tuple[int, ...]
    positions: tuple[int, ...] | None = None
    also: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if any(layer < self.layer for layer, _ in self.also):
            raise ValueError("a patch's extra heads must be in its layer or later ones (the row joins at its layer)")

    @classmethod
    def together(cls, heads: Sequence[tuple[int, int]]) -> HeadPatch:
        """One row patching every (layer, head) of ``heads`` (any layers) together."""
        ordered = sorted(heads)
        first = ordered[0][0]
        also = tuple(x for x in ordered if x[0] != first)
        return cls(first, tuple(h for layer, h in ordered if layer == first), also=also)


@dataclass(frozen=True)
class RecordedRun:
    """One clean forward: its output at the kept positions (or what a readout keeps of it) and every head's output
    before W_O."""

    output: Tensor  # (K, V) logits (or (K, C) hidden states) at the kept positions; with a readout its first tensor
    heads: dict[int, Tensor]  # layer -> (T, H, D)


def encoder_or_model(loaded: LoadedModel, ids: Tensor, *, logits_to_keep: int | None = None, **extra: object) -> object:
    """The model on ``ids`` with ``extra`` arguments, a language model's head seeing only the last ``logits_to_keep``
    positions (None: all); an encoder–decoder's encoder alone (its heads are the encoder stack's, measured on the
    encoder's output, as for an encoder-only model)."""
    if loaded.facts.is_encoder_decoder:
        return encoder_of(loaded)(input_ids=ids)
    if logits_to_keep is not None and loaded.facts.is_language_model:
        extra["logits_to_keep"] = logits_to_keep
    return loaded.model(input_ids=ids, **extra)


def recorded_run(
    loaded: LoadedModel,
    input_ids: Tensor,
    *,
    keep_last: bool = True,
    readout: Readout | None = None,
    layers: Sequence[int] | None = None,
) -> RecordedRun:
    """A forward of (1, T) ids recording the head outputs of ``layers`` (None: every layer); the output at the last
    position (or all), or with ``readout`` (:mod:`agent_tools.runner.readout`) only the first tensor it keeps (e.g.
    (T−1,) losses)."""
    facts = loaded.facts
    ids = on_device(loaded, input_ids)
    layers = list(range(facts.num_layers)) if layers is None else list(layers)
    with loaded.lock, torch.inference_mode():
        with recorded_head_inputs(loaded.model, layers, num_heads=facts.num_heads, head_dim=facts.head_dim) as heads:
            output, _ = model_output(
                encoder_or_model(loaded, ids, use_cache=False, logits_to_keep=1 if keep_last else None)
            )
        kept = readout(output)[0][0] if readout is not None else output[0].float().clone()
        return RecordedRun(output=kept, heads=dict(heads))


def set_masks(
    patches: Sequence[HeadPatch], length: int, num_heads: int, *, start: int = 0
) -> tuple[dict[int, Tensor], dict[int, int]]:
    """Rows of patches sorted by layer (rows may patch several layers: ``HeadPatch.also``) as the masks and joining
    counts of :func:`agent_tools.intervene.heads_patched_joining`.

    Row 0 is the unpatched run, patch ``i`` row ``i + 1``, joining at ``patch.layer``. Returns (layer -> (R_l,
    T − start, H) bool masks for every layer some row patches — (R_l, 1, H), the same at every position, when no
    patch names positions —, layer -> rows joining there).
    """
    if any(a.layer > b.layer for a, b in itertools.pairwise(patches)):
        raise ValueError("patches must be sorted by layer")
    joining: dict[int, int] = {}
    for patch in patches:
        joining[patch.layer] = joining.get(patch.layer, 0) + 1
    width = length - start if any(patch.positions is not None for patch in patches) else 1
    masks: dict[int, Tensor] = {}
    for row, patch in enumerate(patches, start=1):
        positions = list(patch.positions) if patch.positions is not None else list(range(start, start + width))
        kept = [p - start for p in positions if p >= start]
        for layer, heads in group_heads([*((patch.layer, head) for head in patch.heads), *patch.also]).items():
            alive = 1 + sum(1 for other in patches if other.layer <= layer)
            mask = masks.setdefault(layer, torch.zeros(alive, width, num_heads, dtype=torch.bool))
            if kept:
                mask[row, torch.tensor(kept, dtype=torch.long)[:, None], torch.tensor(heads)] = True
    return masks, joining


def _prefix_cache(loaded: LoadedModel, ids: Tensor, prefix: int) -> list[tuple[Tensor, Tensor]] | None:
    """The KV cache of the first ``prefix`` tokens (None when the model's cache cannot be reused this way)."""
    if prefix <= 0 or loaded.facts.sliding_window is not None:
        return None
    return cache_layers(loaded.model(input_ids=ids[:, :prefix], use_cache=True, logits_to_keep=1))


def rows_per_batch(loaded: LoadedModel, length: int, budget: int, *, output_positions: int | None = 1) -> int:
    """How many rows of ``length`` tokens one forward may carry within ``budget`` bytes of activations and of the
    batch's own output (vocabulary rows at the last ``output_positions`` positions per row — None: at every one —,
    float32, while its readout runs), at most :data:`BATCH_ROWS` (patched, ablated and restricted rows alike)."""
    outputs = length if output_positions is None else min(length, output_positions)
    return min(BATCH_ROWS, max(1, budget // max(row_bytes(loaded, length, output_positions=outputs), 1)))


def row_bytes(loaded: LoadedModel, length: int, *, output_positions: int = 1) -> int:
    """Bytes one row of ``length`` tokens holds while its batch runs: its activations, ``output_positions``
    vocabulary rows of its output (float32), and, where the model's own attention is eager, one layer's scores and
    weights (2 × heads × length², float32: sdpa's CPU and CUDA kernels never hold them; at 8,192 tokens on a
    4-head model they are 2 GiB a row, which the activations alone put at 3 MiB)."""
    weight = getattr(output_head(loaded.model), "weight", None)
    vocabulary = int(weight.shape[0]) if isinstance(weight, Tensor) else 0
    maps = 2 * loaded.facts.num_heads * length * length if default_implementation(loaded) == "eager" else 0
    return (length * loaded.facts.hidden_size * ROW_ACTIVATION_FLOATS + output_positions * vocabulary + maps) * 4


def patched_outputs(
    loaded: LoadedModel,
    input_ids: Tensor,
    patches: Sequence[HeadPatch],
    *,
    readout: Readout,
    sources: dict[int, Tensor] | None = None,
    keep_last: bool = True,
    max_rows: int = BATCH_ROWS,
    prefix: int = 0,
) -> tuple[Tensor, ...]:
    """(1, T) ids and R patches -> what ``readout`` keeps of each row's output, each tensor with R rows in the
    order given (the output: (B, K, V) logits, K = 1 at the last position with ``keep_last``, else T).

    ``readout`` (:mod:`agent_tools.runner.readout`) runs on every batch's output on its device; only what it
    returns outlives the batch, so no (rows, positions, vocabulary) block is ever kept.
    ``sources``: layer -> (T, H, D) head outputs to copy in (another run's, :func:`recorded_run`); None zeroes the
    patched heads (zero ablation). Rows are sorted by layer and sent in batches of at most ``max_rows``.
    ``prefix``: the first tokens where the source run's head outputs equal this run's (two prompts that differ
    only later): patches there change nothing, so those positions run once, as a KV cache every batch reuses.
    """
    facts = loaded.facts
    ids = on_device(loaded, input_ids)
    length = int(ids.shape[-1])
    order = sorted(range(len(patches)), key=lambda i: patches[i].layer)
    parts: list[tuple[Tensor, ...]] = []
    start = 0
    with loaded.lock, torch.inference_mode():
        cached = _prefix_cache(loaded, ids, min(prefix, length - 1)) if keep_last else None
        skip = int(cached[0][0].shape[-2]) if cached else 0
        while start < len(order):
            group = order[start : start + max_rows]
            start += len(group)
            batch = [patches[i] for i in group]
            masks, joining = set_masks(batch, length, facts.num_heads, start=skip)
            replaced = {
                key: [(mask, sources[key][skip:] if sources is not None else None)] for key, mask in masks.items()
            }
            extra: dict[str, object] = {"use_cache": cached is not None}
            if cached is not None:
                alive = [1 + sum(1 for patch in batch if patch.layer <= layer) for layer in range(len(cached))]
                extra[_cache_argument(loaded.model)] = cache_of(cached, alive)  # at each layer the rows running there
            patching = heads_patched_joining(
                loaded.model, replaced, joining, num_heads=facts.num_heads, head_dim=facts.head_dim
            )
            with patching, contiguous_input(output_head(loaded.model)):
                output, _ = model_output(  # row 0: unpatched
                    encoder_or_model(loaded, ids[:, skip:], logits_to_keep=1 if keep_last else None, **extra)
                )
            parts.append(tuple(kept[1:] for kept in readout(output)))  # this batch's rows, in ``group`` order
            del output
    if not parts:
        return ()
    sorted_rows = stacked(parts)  # rows in ``order``
    restore = torch.empty(len(order), dtype=torch.long)
    restore[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return tuple(kept[restore.to(kept.device)] for kept in sorted_rows)  # rows in the order given
