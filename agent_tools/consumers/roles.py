"""Head-role scores, streamed: per-row role shares summed block by block (query chunks, batch rows).

The roles and their formulas are :mod:`agent_tools.analysis.heads`' (``ROLE_FORMULAS``); this module keeps the
(H, R) running sums per layer, never a map. ``role_scores`` is the whole-map entry point on the same sums.
Blocks are scored on their own device; one (H + 1, R) block of sums and counts crosses to the CPU per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from agent_tools.analysis.heads import HEAD_ROLES, PROBE_ROLES, HeadRole, SequenceLayout
from agent_tools.analysis.metrics import attention_entropy, normalised_from_entropy
from agent_tools.capture import LayerAttention
from agent_tools.consumers.host import to_host


class RoleAccumulator:
    """Sums of per-row role shares for every head of one layer, fed block by block (query chunks, batch rows).

    ``add`` takes one block; ``scores`` divides the sums by the number of rows scored. Works for any chunking:
    the result equals the same formulas on the whole map.
    """

    def __init__(self, layout: SequenceLayout, roles: Sequence[HeadRole], num_heads: int) -> None:
        self.layout = layout
        self.roles = tuple(r for r in roles if layout.measurable(r))
        self.kernel_roles = tuple(r for r in self.roles if r != "broad")
        self.sums = torch.zeros(num_heads, len(self.roles), dtype=torch.float64)  # on the CPU, whatever the device
        self.counts = torch.zeros(len(self.roles), dtype=torch.float64)

    def add(
        self, weights: Tensor, rows: Tensor, allowed: Tensor | None = None, *, entropy: Tensor | None = None
    ) -> None:
        """weights (B, H, q, k) softmax rows; rows (q,) absolute positions; allowed (B, 1, q, k) bool or None;
        entropy (B, H, q) row entropies in nats when the caller already has them (``broad``).

        Each kernel role reads O(B·H·q) entries (diagonals, a column, one matrix-vector product for the flag
        roles) instead of multiplying the maps by dense kernels: the same sums as :func:`role_kernels` gives.
        The block is scored where ``weights`` are (``rows`` and ``allowed`` must be there too).
        """
        batch, heads, q, keys = weights.shape
        w = weights if weights.dtype == torch.float32 else weights.float()
        if allowed is not None:
            visible = allowed[:, 0]  # (B, q, k)
        else:
            visible = torch.ones(batch, q, keys, dtype=torch.bool, device=w.device)
        visible = visible.expand(batch, q, keys)
        scored = rows >= self.layout.skip_queries  # (q,)
        block = w.new_zeros(heads + 1, len(self.roles), dtype=torch.float64)  # rows 0..H-1: sums; row H: counts
        for role in self.kernel_roles:
            share, row_mask = self._role_rows(role, w, rows, visible, scored)  # (B, H, q), (B, q)
            slot = self.roles.index(role)
            block[:heads, slot] = torch.einsum("bhq,bq->h", share, row_mask.to(share.dtype)).double()
            block[heads, slot] = row_mask.sum()
        if "broad" in self.roles:
            count = visible.sum(-1)  # (B, q) keys each row may read
            rows_ok = scored[None] & (count >= 2)  # (B, q)
            if entropy is None:
                entropy = attention_entropy(w)  # (B, H, q) nats
            normalised = normalised_from_entropy(entropy.float(), count[:, None].float())  # (B, H, q)
            slot = self.roles.index("broad")
            block[:heads, slot] = torch.einsum("bhq,bq->h", normalised, rows_ok.float()).double()
            block[heads, slot] = rows_ok.sum()
        sums = to_host(block)
        self.sums += sums[:heads]
        self.counts += sums[heads]

    def _role_rows(
        self, role: HeadRole, w: Tensor, rows: Tensor, visible: Tensor, scored: Tensor
    ) -> tuple[Tensor, Tensor]:
        """One kernel role on a block: per-row share (B, H, q) and the rows it is defined on (B, q)."""
        layout = self.layout
        batch, keys = w.shape[0], w.shape[-1]

        def on_rows(mask: Tensor) -> Tensor:
            return mask[None].expand(batch, -1)  # (q,) -> (B, q)

        if role == "previous_token":
            return _diagonal(w, rows, -1), on_rows(scored & (rows >= 1))
        if role == "next_token":
            return _diagonal(w, rows, 1), on_rows(scored & (rows <= layout.length - 2))
        if role == "self":
            return _diagonal(w, rows, 0), on_rows(scored)
        if role == "first_token":  # metrics.first_token_share_excluding_early_rows, row by row
            return w[..., 0], on_rows(scored & (rows >= 1))
        if role == "local":
            offsets = [d for d in range(-layout.local_window, layout.local_window + 1) if abs(d) >= 2]
            share = sum((_diagonal(w, rows, d, min_key=1) for d in offsets), torch.zeros_like(w[..., 0]))
            return share, on_rows(scored)
        if role in ("special_token", "punctuation"):
            flags = torch.tensor(layout.special if role == "special_token" else layout.punctuation, device=w.device)
            flags = flags[:keys].float()
            flags[0] = 0.0  # the first token is first_token's
            own = flags[rows.clamp(0, keys - 1)] * (rows < keys)  # (q,) the row's own key, excluded (j != i)
            share = w @ flags - _diagonal(w, rows, 0) * own  # (B, H, q)
            seen = visible.float() @ flags - _diagonal(visible[:, None].float(), rows, 0)[:, 0] * own  # (B, q)
            return share, on_rows(scored) & (seen > 0)
        if role in PROBE_ROLES:
            if layout.repeat is None:
                raise ValueError(f"role {role!r} needs a probe layout (repeat=(start, N))")
            start, n = layout.repeat
            second = (rows >= start + n) & (rows < start + 2 * n)
            return _diagonal(w, rows, -n + 1 if role == "induction" else -n), on_rows(second)
        raise ValueError(f"{role!r} is not a kernel role")

    def scores(self) -> dict[HeadRole, Tensor]:
        """role -> (H,) mean share; roles with no scored row are left out."""
        return {
            role: (self.sums[:, slot] / self.counts[slot]).float()
            for slot, role in enumerate(self.roles)
            if self.counts[slot] > 0
        }


def _diagonal(w: Tensor, rows: Tensor, offset: int, *, min_key: int = 0) -> Tensor:
    """(B, H, q, k) -> (B, H, q): ``w[..., r, rows[r] + offset]``, 0 where that key is outside min_key..k-1."""
    keys = w.shape[-1]
    target = rows + offset  # (q,)
    valid = (target >= min_key) & (target < keys)
    index = target.clamp(0, keys - 1).view(1, 1, -1, 1).expand(*w.shape[:-1], 1)  # (B, H, q, 1)
    return torch.gather(w, -1, index).squeeze(-1) * valid.to(w.dtype)


def role_scores(
    weights: Tensor, layout: SequenceLayout, roles: Sequence[HeadRole] = HEAD_ROLES, allowed: Tensor | None = None
) -> dict[HeadRole, Tensor]:
    """Whole maps (H, T, T) or (B, H, T, T) -> role -> (H,) scores, by the formulas in the module docstring."""
    maps = weights if weights.dim() == 4 else weights[None]  # (B, H, T, T)
    if allowed is not None and allowed.dim() == 2:
        allowed = allowed[None, None]  # (1, 1, T, T)
    elif allowed is None and layout.causal:
        length = maps.shape[-1]
        allowed = torch.ones(length, length, dtype=torch.bool, device=maps.device).tril()[None, None]
    accumulator = RoleAccumulator(layout, roles, maps.shape[1])
    accumulator.add(maps, torch.arange(maps.shape[-2], device=maps.device), allowed)
    return accumulator.scores()


class RoleScoreConsumer:
    """Streams capture: per layer, the role scores of every head; keeps (H, R) sums per layer, never a map."""

    accepts_key_prefix: ClassVar[bool] = True  # columns past key_width carry weight 0: every role sum over them is 0

    def __init__(self, layout: SequenceLayout, roles: Sequence[HeadRole], num_heads: int) -> None:
        self.layout = layout
        self.roles = tuple(roles)
        self.num_heads = num_heads
        self.layers: dict[int, RoleAccumulator] = {}

    def on_layer(self, layer: LayerAttention) -> None:
        accumulator = self.layers.setdefault(layer.layer, RoleAccumulator(self.layout, self.roles, self.num_heads))
        q = layer.weights.shape[2]
        # (q,) absolute positions (no KV cache: = query_start + r), on the layer's device
        rows = torch.arange(q, device=layer.weights.device) + layer.key_index_offset
        accumulator.add(layer.weights, rows, layer.allowed(), entropy=layer.row_entropy())

    def scores(self) -> dict[int, dict[HeadRole, Tensor]]:
        return {index: acc.scores() for index, acc in sorted(self.layers.items())}
