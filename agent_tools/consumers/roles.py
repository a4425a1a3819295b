"""Head-role and pattern scores, streamed: per-row shares summed block by block (query chunks, batch rows).

The roles, their kernels and formulas are :mod:`agent_tools.analysis.heads`' registry (``ROLES``); a user's pattern
is scored the same way (``share_i = Σ_j A[i, j] · P[i, j]``, averaged over the rows ``i ≥ skip`` that may read a
key of ``P``). This module keeps the (H, R) running sums per layer, never a map. ``role_scores`` and
``pattern_scores`` are the whole-map entry points on the same sums. Blocks are scored on their own device; one
(H + 1, R) block of sums and counts crosses to the CPU per block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, Generic, cast

import torch
from torch import Tensor

from agent_tools.analysis.heads import HEAD_ROLES, ROLES, HeadRole, KeyReader, Name, SequenceLayout, user_pattern
from agent_tools.analysis.metrics import attention_entropy, normalised_from_entropy
from agent_tools.capture import LayerAttention
from agent_tools.consumers.host import PendingSums, accumulation_dtype

BROAD: HeadRole = "broad"  # the one role scored by entropy rather than a key pattern


class ShareAccumulator:
    """Sums of per-row pattern shares for every head of one layer, fed block by block (query chunks, batch rows).

    ``readers``: name -> :class:`~agent_tools.analysis.heads.KeyReader`; ``entropy_name``: also sum the normalised
    entropy under that name (the ``broad`` role). ``add`` takes one block; ``scores`` divides the sums by the
    number of rows scored. Works for any chunking: the result equals the same formulas on the whole map.
    """

    def __init__(
        self, readers: Mapping[str, KeyReader], num_heads: int, *, skip_queries: int, entropy_name: str | None = None
    ) -> None:
        self.readers = dict(readers)
        self.skip_queries = skip_queries
        self.entropy_name = entropy_name
        self.names = (*self.readers, *([entropy_name] if entropy_name else []))
        self.sums = torch.zeros(num_heads, len(self.names), dtype=torch.float64)  # on the CPU, whatever the device
        self.counts = torch.zeros(len(self.names), dtype=torch.float64)
        self._pending = PendingSums()  # blocks added on the device since the last flush

    def add(
        self, weights: Tensor, rows: Tensor, allowed: Tensor | None = None, *, entropy: Tensor | None = None
    ) -> None:
        """weights (B, H, q, k) softmax rows; rows (q,) absolute positions; allowed (B, 1, q, k) bool or None;
        entropy (B, H, q) row entropies in nats when the caller already has them (the entropy score).

        A structured pattern reads O(B·H·q) entries (diagonals, a column, one matrix-vector product for flagged
        keys); a dense user pattern multiplies the block by its (q, k) rows. The rows scored are those past
        ``skip_queries`` that may read at least one key of the pattern (the same reader applied to ``allowed``).
        The block is scored where ``weights`` are (``rows`` and ``allowed`` must be there too).
        """
        batch, heads, q, keys = weights.shape
        w = weights if weights.dtype == torch.float32 else weights.float()
        if allowed is not None:
            visible = allowed[:, 0].expand(batch, q, keys)  # (B, q, k)
        else:
            visible = torch.ones(batch, q, keys, dtype=torch.bool, device=w.device)
        scored = (rows >= self.skip_queries)[None]  # (1, q)
        dtype = accumulation_dtype(w.device)
        block = w.new_zeros(heads + 1, len(self.names), dtype=dtype)  # rows 0..H-1: sums; row H: counts
        visible_float = visible.float()
        for slot, reader in enumerate(self.readers.values()):
            share = reader.read(w, rows)  # (B, H, q)
            row_mask = scored & (reader.read(visible_float, rows) > 0)  # (B, q): may read a key of the pattern
            block[:heads, slot] = torch.einsum("bhq,bq->h", share, row_mask.to(share.dtype)).to(dtype)
            block[heads, slot] = row_mask.sum()
        if self.entropy_name is not None:
            count = visible.sum(-1)  # (B, q) keys each row may read
            rows_ok = scored & (count >= 2)  # (B, q)
            if entropy is None:
                entropy = attention_entropy(w)  # (B, H, q) nats
            normalised = normalised_from_entropy(entropy.float(), count[:, None].float())  # (B, H, q)
            slot = len(self.names) - 1
            block[:heads, slot] = torch.einsum("bhq,bq->h", normalised, rows_ok.float()).to(dtype)
            block[heads, slot] = rows_ok.sum()
        self._pending.add("block", block)  # summed on the device; crosses to the CPU in flush()

    def flush(self) -> None:
        """Move the blocks added since the last flush to the CPU sums, in one copy (a layer's last chunk)."""
        moved = self._pending.take()
        if moved:
            heads = self.sums.shape[0]
            self.sums += moved["block"][:heads]
            self.counts += moved["block"][heads]

    def scores(self) -> dict[str, Tensor]:
        """name -> (H,) mean share; names with no scored row are left out."""
        self.flush()
        return {
            name: (self.sums[:, slot] / self.counts[slot]).float()
            for slot, name in enumerate(self.names)
            if self.counts[slot] > 0
        }


class RoleAccumulator(ShareAccumulator):
    """:class:`ShareAccumulator` over the registry's roles measurable on ``layout``."""

    def __init__(self, layout: SequenceLayout, roles: Sequence[HeadRole], num_heads: int) -> None:
        self.layout = layout
        self.roles = tuple(r for r in roles if layout.measurable(r))
        readers: dict[str, KeyReader] = {r: p for r in self.roles if (p := ROLES[r].pattern(layout)) is not None}
        super().__init__(
            readers,
            num_heads,
            skip_queries=layout.skip_queries,
            entropy_name=BROAD if BROAD in self.roles else None,
        )


def _whole_maps(weights: Tensor, allowed: Tensor | None, causal: bool) -> tuple[Tensor, Tensor | None]:
    """(H, T, T) or (B, H, T, T) maps and an optional (T, T) / (B, 1, T, T) mask -> 4-d both."""
    maps = weights if weights.dim() == 4 else weights[None]  # (B, H, T, T)
    if allowed is not None and allowed.dim() == 2:
        allowed = allowed[None, None]  # (1, 1, T, T)
    elif allowed is None and causal:
        length = maps.shape[-1]
        allowed = torch.ones(length, length, dtype=torch.bool, device=maps.device).tril()[None, None]
    return maps, allowed


def role_scores(
    weights: Tensor, layout: SequenceLayout, roles: Sequence[HeadRole] = HEAD_ROLES, allowed: Tensor | None = None
) -> dict[HeadRole, Tensor]:
    """Whole maps (H, T, T) or (B, H, T, T) -> role -> (H,) scores, by the registry's formulas."""
    maps, allowed = _whole_maps(weights, allowed, layout.causal)
    accumulator = RoleAccumulator(layout, roles, maps.shape[1])
    accumulator.add(maps, torch.arange(maps.shape[-2], device=maps.device), allowed)
    return cast(dict[HeadRole, Tensor], accumulator.scores())  # roles with no scored row are left out


UserPattern = Tensor | Callable[[Tensor], Tensor]  # (T, T) weights in [0, 1], or token ids (T,) -> such a tensor


def pattern_scores(
    weights: Tensor,
    pattern: UserPattern,
    *,
    input_ids: Tensor | None = None,
    causal: bool = True,
    skip_queries: int = 0,
    allowed: Tensor | None = None,
) -> Tensor:
    """Whole maps (H, T, T) or (B, H, T, T) and a user's pattern -> (H,) scores, as the built-in roles score.

    ``pattern``: a (T, T) query × key tensor of weights in [0, 1] (a bool mask), or a function of the (T,) token
    ids (``input_ids``, required then) returning one. Score = mean over rows ``i ≥ skip_queries`` that may read a
    key with ``P[i, j] > 0`` of ``Σ_j A[i, j] · P[i, j]``; NaN when no row qualifies. ``causal`` adds the causal
    mask when ``allowed`` is None. A pattern equal to a built-in role's kernel gives that role's score.
    """
    maps, allowed = _whole_maps(weights, allowed, causal)
    length = maps.shape[-1]
    if callable(pattern) and input_ids is None:
        raise ValueError("a pattern function needs the sequence's input_ids")
    ids = input_ids if input_ids is not None else torch.arange(length)
    reader = user_pattern(pattern, ids.reshape(-1).to(maps.device))
    accumulator = ShareAccumulator({"pattern": reader}, maps.shape[1], skip_queries=skip_queries)
    accumulator.add(maps, torch.arange(maps.shape[-2], device=maps.device), allowed)
    return accumulator.scores().get("pattern", torch.full((maps.shape[1],), float("nan")))


class ShareScoreConsumer(Generic[Name]):
    """Streams capture: per layer, every head's share of each pattern (``Name``: a role or a pattern name); keeps
    (H, R) sums per layer, never a map."""

    accepts_key_prefix: ClassVar[bool] = True  # columns past key_width carry weight 0: every share over them is 0

    def __init__(self, make: Callable[[], ShareAccumulator]) -> None:
        self.make = make
        self.layers: dict[int, ShareAccumulator] = {}

    def on_layer(self, layer: LayerAttention) -> None:
        accumulator = self.layers.get(layer.layer)
        if accumulator is None:
            accumulator = self.layers[layer.layer] = self.make()
        q = layer.weights.shape[2]
        # (q,) absolute positions (no KV cache: = query_start + r), on the layer's device
        rows = torch.arange(q, device=layer.weights.device) + layer.key_index_offset
        entropy = layer.row_entropy() if accumulator.entropy_name is not None else None
        accumulator.add(layer.weights, rows, layer.allowed(), entropy=entropy)
        if layer.last_chunk:
            accumulator.flush()  # the layer's last chunk: its sums cross to the CPU in one copy

    def scores(self) -> dict[int, dict[Name, Tensor]]:
        """layer -> name -> (H,) score; names with no scored row are left out."""
        return {index: cast(dict[Name, Tensor], acc.scores()) for index, acc in sorted(self.layers.items())}


class RoleScoreConsumer(ShareScoreConsumer[HeadRole]):
    """The registry's roles on one sequence, streamed (see :class:`ShareScoreConsumer`)."""

    def __init__(self, layout: SequenceLayout, roles: Sequence[HeadRole], num_heads: int) -> None:
        roles = tuple(roles)
        super().__init__(lambda: RoleAccumulator(layout, roles, num_heads))


class PatternScoreConsumer(ShareScoreConsumer[str]):
    """Named patterns (name -> reader, built for this sequence) on one sequence, streamed."""

    def __init__(self, readers: Mapping[str, KeyReader], num_heads: int, *, skip_queries: int) -> None:
        readers = dict(readers)
        super().__init__(lambda: ShareAccumulator(readers, num_heads, skip_queries=skip_queries))
