"""Forward passes with heads restricted to a short KV cache (sink + window), batched per layer group.

``plan_kv_cache`` asks, for every KV head, how much the next-token loss changes when that head reads only the first
``sink`` and the last ``window`` keys. One forward per head would cost ``L·Hkv`` passes. Here a head is a *row* of a
batch: the rows are sorted by layer and a row joins the batch at the layer it restricts, as a copy of the unrestricted
row 0 (:func:`agent_tools.intervene.rows_joining`), so the layers before it run once,
in row 0. Each batch is one masked pass over a group of consecutive layers (as many rows as the memory budget
allows). Row 0's own output is the same in every pass, so it is computed once: in the pass whose rows join last
(it runs the whole model there), while in every other pass row 0 leaves the batch after the last layer where rows
join. The loss of row ``r`` minus that unrestricted loss is the head's effect (the rows of another pass ran the
same layers in a batch one row smaller: the numbers agree with a same-batch row 0 to float rounding, 1e-6 in the
tests).

Logits are never held for the whole batch: the output head's input (R, T, C) is kept, the model's own head sees one
position, and the per-position losses are computed from the kept input in chunks of positions.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from agent_tools.capture import hooks_registered, soft_capped
from agent_tools.families import output_head
from agent_tools.intervene import row_zero_leaving, rows_joining
from agent_tools.loading import LoadedModel
from agent_tools.restricted_attention import heads_restricted
from agent_tools.runner.forward import on_device

LOGIT_CHUNK_FLOATS = 1 << 24  # logits computed at once when turning kept hidden states into losses


@dataclass(frozen=True)
class RestrictedLosses:
    """Per-position next-token losses of an unrestricted row and of restricted rows (tensors for the service)."""

    clean: Tensor  # (S,) loss predicting token t+1 at scored position t (t ≥ sink + window), no head restricted
    clean_top: Tensor  # (S,) the unrestricted model's top next token at each scored position
    rows: Tensor  # (U, S) the same with unit u restricted
    clean_rows: Tensor  # (U, S) the unrestricted losses unit u is compared with (``clean`` for every unit)
    top: Tensor  # (U, S) the top next token with unit u restricted
    passes: int  # masked forwards run


@contextmanager
def _kept_head_input(model: nn.Module, keep: dict[str, Tensor]) -> Iterator[nn.Module]:
    """Inside the block, the output head's input (R, T, C) is kept and the head itself sees the last position only."""
    head = output_head(model)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings to compute a next-token loss with")

    def hook(module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]  # (R, T, C)
        keep["hidden"] = hidden
        return (hidden[:, -1:].contiguous(), *args[1:])

    with hooks_registered([head.register_forward_pre_hook(hook)]):
        yield head


def _losses(model: nn.Module, head: nn.Module, hidden: Tensor, ids: Tensor, first: int) -> tuple[Tensor, Tensor]:
    """(R, T, C) final hidden states and (T,) ids -> (R, T−1−first) next-token losses and top tokens of the
    predictions made at positions ``first..T−2``, in position chunks."""
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    rows, length, _ = hidden.shape
    vocab = int(getattr(head, "out_features", 0) or 0) or 50_000  # only sizes the chunks
    chunk = max(1, LOGIT_CHUNK_FLOATS // max(1, vocab))
    targets = ids[1:]
    count = length - 1 - first
    losses = torch.empty(rows, count, dtype=torch.float32)
    top = torch.empty(rows, count, dtype=torch.long)
    for row in range(rows):
        for start in range(0, count, chunk):
            stop = min(start + chunk, count)
            logits = head(hidden[row, first + start : first + stop]).float()  # (c, V)
            logits = soft_capped(logits, softcap or None)
            target = targets[first + start : first + stop].to(logits.device)
            losses[row, start:stop] = torch.nn.functional.cross_entropy(logits, target, reduction="none").cpu()
            top[row, start:stop] = logits.argmax(-1).cpu()
    return losses, top


def restricted_pass(
    loaded: LoadedModel,
    input_ids: Tensor,
    restrictions: dict[int, list[tuple[int, Sequence[int]]]],
    *,
    rows: int,
    sink: int,
    window: int,
    joining: dict[int, int] | None = None,
    scored_from: int = 0,
    clean_leaves: bool = False,
) -> tuple[Tensor, Tensor]:
    """One forward of (1, T) ids as a batch of ``rows`` rows with ``restrictions`` (layer -> [(row, query heads)]).

    ``joining``: layer -> rows that join the batch at that layer (copies of row 0; rows 1.. join in layer order);
    None runs all ``rows`` from the embedding on. ``clean_leaves`` (with ``joining``): row 0 leaves the batch after
    the last layer where rows join (unless that is the model's last layer), and only rows 1.. are returned.
    Returns (rows, T−1−scored_from) next-token losses and top tokens of the predictions made at positions
    ``scored_from..T−2`` (rows − 1 of them when row 0 left).
    """
    facts = loaded.facts
    ids = on_device(loaded, input_ids)
    keep: dict[str, Tensor] = {}
    leaves = max(joining) + 1 if clean_leaves and joining and max(joining) + 1 < facts.num_layers else None
    with loaded.lock, torch.inference_mode():
        with (
            _kept_head_input(loaded.model, keep) as head,
            heads_restricted(loaded.model, restrictions, sink=sink, window=window),
        ):
            if joining:
                with (
                    row_zero_leaving(loaded.model, leaves) if leaves is not None else nullcontext(),
                    rows_joining(loaded.model, joining, num_heads=facts.num_heads),
                ):
                    loaded.model(input_ids=ids, use_cache=False)
            else:
                loaded.model(input_ids=ids.expand(rows, -1), use_cache=False)
        hidden = keep.pop("hidden")
        expected = rows - 1 if leaves is not None else rows
        if hidden.shape[0] != expected:
            raise ValueError(f"the restricted pass ran {hidden.shape[0]} rows, expected {expected}")
        losses, top = _losses(loaded.model, head, hidden, ids[0], scored_from)
        if clean_leaves and leaves is None:  # the rows joined at the last layer: row 0 ran to the end, drop it here
            return losses[1:], top[1:]
        return losses, top


def unit_losses(
    loaded: LoadedModel,
    input_ids: Tensor,
    units: Sequence[tuple[int, Sequence[int]]],
    *,
    sink: int,
    window: int,
    max_rows: int,
) -> RestrictedLosses:
    """Every unit (layer, query heads) restricted on its own, as rows of joining batches of at most ``max_rows``.

    Units must be sorted by layer. A batch holds row 0 (unrestricted) and up to ``max_rows − 1`` units of
    consecutive layers: one masked pass per layer group. Row 0 runs the whole model in the last pass only (its
    losses are the unrestricted ones); in the others it leaves after the last layer where that pass's rows join.
    Only the predictions at positions ``sink + window`` and later are scored (earlier queries read every earlier
    key either way).
    """
    if any(a[0] > b[0] for a, b in itertools.pairwise(units)):
        raise ValueError("units must be sorted by layer")
    if not units:
        raise ValueError("unit_losses needs at least one unit")
    per_batch = max(1, max_rows - 1)
    starts = list(range(0, len(units), per_batch))
    rows_out, top_out = [], []
    clean = clean_top = None
    for start in starts:
        group = units[start : start + per_batch]
        last = start == starts[-1]  # its rows join last: row 0 runs to the end here, and only here
        joining: dict[int, int] = {}
        restrictions: dict[int, list[tuple[int, Sequence[int]]]] = {}
        for row, (layer, heads) in enumerate(group, start=1):
            joining[layer] = joining.get(layer, 0) + 1
            restrictions.setdefault(layer, []).append((row, tuple(heads)))
        losses, top = restricted_pass(
            loaded,
            input_ids,
            restrictions,
            rows=len(group) + 1,
            sink=sink,
            window=window,
            joining=joining,
            scored_from=sink + window,
            clean_leaves=not last,
        )
        if last:
            clean, clean_top = losses[0], top[0]
            losses, top = losses[1:], top[1:]
        rows_out.append(losses)
        top_out.append(top)
    assert clean is not None and clean_top is not None
    rows = torch.cat(rows_out)
    return RestrictedLosses(
        clean=clean,
        clean_top=clean_top,
        rows=rows,
        clean_rows=clean[None].expand_as(rows),
        top=torch.cat(top_out),
        passes=len(starts),
    )
