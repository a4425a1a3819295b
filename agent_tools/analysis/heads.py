"""Head roles: what each attention head does, as attention shares with documented formulas.

Every score is a mean of attention weights (or of normalised entropy for ``broad``), so it lies in [0, 1] and
is comparable across heads and models. ``A`` is one head's map, rows are queries ``i``, columns keys ``j``,
``T`` the sequence length. Scored queries are ``i ≥ skip_queries`` (early causal rows see one or two keys, so
their shares say nothing about the head); each role further keeps only the rows where it is defined.

Text roles (measured on the user's text, or on the built-in sample text):

* ``previous_token``: mean ``A[i, i−1]``.
* ``next_token``: mean ``A[i, i+1]`` (bidirectional models only; a causal row cannot see ``i+1``).
* ``self``: mean ``A[i, i]``.
* ``first_token``: mean ``A[i, 0]`` over ``i ≥ max(1, skip)`` — the first-token / attention-sink share
  (:func:`agent_tools.analysis.metrics.first_token_share_excluding_early_rows`; the ``analyze`` grid's sink
  share is ``metrics.first_token_share``, over every row).
* ``local``: mean ``Σ_{2 ≤ |i−j| ≤ w, j ≥ 1} A[i, j]`` — nearby tokens other than itself, its neighbours and
  the first token (those have their own roles), window ``w = local_window``.
* ``broad``: mean ``H(A[i]) / log(keys visible to i)`` over rows that see at least two keys
  (``metrics.normalised_entropy``).
* ``special_token``: mean ``Σ_{j special, j ≥ 1, j ≠ i} A[i, j]`` over rows that can see such a key
  ([SEP], chat markers; the first token is ``first_token``'s).
* ``punctuation``: the same over punctuation keys.

Probe roles (measured on ``[BOS] r₁ … r_N r₁ … r_N``, ``N`` random distinct tokens repeated once; the
second copy starts at ``s = start + N``):

* ``induction``: mean ``A[i, i−N+1]`` over ``i`` in the second copy — the token after the earlier copy of the
  current token (what an induction head reads to predict the next token).
* ``duplicate_token``: mean ``A[i, i−N]`` over the second copy — the earlier copy of the current token.

Everything here is pure: tensors in, tensors or plain values out; inputs are never modified. The streamed
sums (``RoleAccumulator``, ``role_scores``, ``RoleScoreConsumer``) live in :mod:`agent_tools.consumers.roles`.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from agent_tools.analysis.metrics import next_token_losses

HeadRole = Literal[
    "previous_token",
    "induction",
    "duplicate_token",
    "first_token",
    "self",
    "local",
    "broad",
    "next_token",
    "special_token",
    "punctuation",
]
HEAD_ROLES: tuple[HeadRole, ...] = get_args(HeadRole)
PROBE_ROLES: tuple[HeadRole, ...] = ("induction", "duplicate_token")
TEXT_ROLES: tuple[HeadRole, ...] = tuple(r for r in HEAD_ROLES if r not in PROBE_ROLES)

# A head takes a role when its score reaches the role's threshold (each a share of attention, broad a share of
# the maximum entropy). Chosen so that a head putting clearly more than chance on the pattern qualifies.
DEFAULT_THRESHOLDS: dict[HeadRole, float] = {
    "previous_token": 0.4,
    "induction": 0.3,
    "duplicate_token": 0.3,
    "first_token": 0.5,
    "self": 0.3,
    "local": 0.5,
    "broad": 0.8,
    "next_token": 0.4,
    "special_token": 0.3,
    "punctuation": 0.3,
}

ROLE_FORMULAS: dict[HeadRole, str] = {
    "previous_token": "mean A[i, i-1] over queries i >= max(1, skip)",
    "induction": "probe: mean A[i, i-N+1] over queries i in the second copy (token after the earlier copy)",
    "duplicate_token": "probe: mean A[i, i-N] over queries i in the second copy (the earlier copy itself)",
    "first_token": "mean A[i, 0] over queries i >= max(1, skip) (first-token / attention-sink share)",
    "self": "mean A[i, i] over queries i >= skip",
    "local": "mean of sum A[i, j] over 2 <= |i-j| <= window, j >= 1, queries i >= skip",
    "broad": "mean entropy(A[i]) / log(visible keys) over queries i >= skip seeing >= 2 keys",
    "next_token": "mean A[i, i+1] over queries i >= skip (bidirectional models only)",
    "special_token": "mean of sum A[i, j] over special keys j >= 1, j != i, over queries that can see one",
    "punctuation": "mean of sum A[i, j] over punctuation keys j >= 1, j != i, over queries that can see one",
}

# Roles a head shows when its own pattern is absent: primary only when no specific role qualifies.
FALLBACK_ROLES: tuple[HeadRole, ...] = ("first_token", "broad")

DEFAULT_SKIP_CAUSAL = 2  # early causal rows see 1–2 keys: their shares are forced, not chosen
DEFAULT_LOCAL_WINDOW = 4

_KERNEL_ROLES: tuple[HeadRole, ...] = tuple(r for r in HEAD_ROLES if r != "broad")


def is_punctuation(text: str) -> bool:
    """A token made only of punctuation characters (Unicode category P*), ignoring surrounding whitespace."""
    stripped = text.strip().lstrip("Ġ▁")
    return bool(stripped) and all(unicodedata.category(c).startswith("P") for c in stripped)


@dataclass(frozen=True)
class SequenceLayout:
    """What the scorers need to know about one sequence: length, which tokens are special or punctuation,
    and, for a probe, where the repeated copies are.

    ``repeat = (start, N)``: the first copy occupies ``start .. start+N-1``, the second the next ``N`` positions.
    """

    length: int
    causal: bool
    special: tuple[bool, ...]
    punctuation: tuple[bool, ...]
    skip_queries: int = 0
    local_window: int = DEFAULT_LOCAL_WINDOW
    repeat: tuple[int, int] | None = None

    @classmethod
    def for_text(
        cls,
        tokens: Sequence[str],
        special: Sequence[bool],
        *,
        causal: bool,
        skip_queries: int | None = None,
        local_window: int = DEFAULT_LOCAL_WINDOW,
    ) -> SequenceLayout:
        skip = (DEFAULT_SKIP_CAUSAL if causal else 0) if skip_queries is None else skip_queries
        return cls(
            length=len(tokens),
            causal=causal,
            special=tuple(bool(s) for s in special),
            punctuation=tuple(not s and is_punctuation(t) for t, s in zip(tokens, special, strict=True)),
            skip_queries=min(skip, max(len(tokens) - 1, 0)),
            local_window=local_window,
        )

    @classmethod
    def for_probe(cls, length: int, *, start: int, repeat_length: int, causal: bool) -> SequenceLayout:
        if start + 2 * repeat_length > length:
            raise ValueError(f"probe of {length} tokens cannot hold two copies of {repeat_length} from {start}")
        flags = (False,) * length
        return cls(length=length, causal=causal, special=flags, punctuation=flags, repeat=(start, repeat_length))

    def measurable(self, role: HeadRole) -> bool:
        """Whether the role can be scored on this sequence at all."""
        if role in PROBE_ROLES:
            return self.repeat is not None
        if role == "next_token":
            return not self.causal
        if role == "special_token":
            return any(self.special[1:])
        if role == "punctuation":
            return any(self.punctuation[1:])
        return self.length >= 2


def role_kernels(
    layout: SequenceLayout, rows: Tensor, key_count: int, roles: Sequence[HeadRole]
) -> tuple[Tensor, Tensor]:
    """Key-selection kernels and row masks for the kernel roles (all but ``broad``) on a block of query rows.

    Args:
        layout: the sequence.
        rows: (q,) absolute query positions of the block.
        key_count: number of key columns (the sequence length without a KV cache).
        roles: kernel roles, in the order of the returned first axis.

    Returns:
        kernels (R, q, k) float: 1 where key j counts for role r at row i; row_masks (R, q) bool: rows scored.
    """
    i = rows[:, None]  # (q, 1)
    j = torch.arange(key_count, device=rows.device)[None, :]  # (1, k)
    distance = j - i  # (q, k)
    first_row = torch.full_like(rows, layout.skip_queries)
    scored = rows >= first_row  # (q,)
    kernels, masks = [], []
    for role in roles:
        if role == "previous_token":
            kernel, mask = distance == -1, scored & (rows >= 1)
        elif role == "next_token":
            kernel, mask = distance == 1, scored & (rows <= layout.length - 2)
        elif role == "self":
            kernel, mask = distance == 0, scored
        elif role == "first_token":
            kernel, mask = (j == 0).expand(len(rows), key_count), scored & (rows >= 1)
        elif role == "local":
            kernel = (distance.abs() >= 2) & (distance.abs() <= layout.local_window) & (j >= 1)
            mask = scored
        elif role in ("special_token", "punctuation"):
            flags = torch.tensor(layout.special if role == "special_token" else layout.punctuation, device=rows.device)
            flags = flags[:key_count]
            kernel = flags[None, :] & (j >= 1) & (distance != 0)
            mask = scored
        elif role in PROBE_ROLES:
            if layout.repeat is None:
                raise ValueError(f"role {role!r} needs a probe layout (repeat=(start, N))")
            start, n = layout.repeat
            second = (rows >= start + n) & (rows < start + 2 * n)
            offset = -n + 1 if role == "induction" else -n
            kernel, mask = distance == offset, second
        else:
            raise ValueError(f"{role!r} is not a kernel role")
        kernels.append(kernel.float())
        masks.append(mask)
    return torch.stack(kernels), torch.stack(masks)


@dataclass(frozen=True)
class HeadClass:
    """A head's primary role (None when no role reaches its threshold), confidence and runner-up."""

    primary: HeadRole | None
    confidence: float
    runner_up: HeadRole | None
    runner_up_score: float | None
    best: HeadRole | None  # the closest role, even when it does not qualify


def role_strength(score: float, threshold: float) -> float:
    """How far a score is past its threshold (0 < τ < 1), scaled so the threshold gives 0 and a perfect score 1."""
    return (score - threshold) / (1 - threshold)


def classify_head(scores: Mapping[HeadRole, float], thresholds: Mapping[HeadRole, float]) -> HeadClass:
    """Primary role = the qualifying role (score ≥ threshold) furthest past its threshold, specific roles first.

    ``first_token`` and ``broad`` are what a head does when its own pattern is absent (it parks on the sink or
    spreads out), so they are primary only when no specific role qualifies: an induction head that rests on the
    first token of ordinary text is still an induction head. Confidence is the primary role's strength
    ``(score − τ) / (1 − τ)`` in [0, 1] (0 = just at the threshold, 1 = a perfect score); the runner-up is the next
    role in the same order (qualifying specific, qualifying fallback, then the rest by strength).
    """
    ranked = sorted(
        ((role_strength(s, thresholds[r]), r) for r, s in scores.items() if not math.isnan(s)),
        key=lambda item: (
            item[0] < 0,  # qualifying roles first
            item[0] >= 0 and item[1] in FALLBACK_ROLES,  # among them, specific before fallback
            -item[0],
            HEAD_ROLES.index(item[1]),
        ),
    )
    if not ranked:
        return HeadClass(None, 0.0, None, None, None)
    strength, best = ranked[0]
    primary = best if strength >= 0 else None
    runner = ranked[1][1] if len(ranked) > 1 else None
    return HeadClass(
        primary=primary,
        confidence=max(0.0, min(1.0, strength)) if primary else 0.0,
        runner_up=runner,
        runner_up_score=float(scores[runner]) if runner else None,
        best=best,
    )


def top_heads(scores: Mapping[int, Mapping[HeadRole, Tensor]], role: HeadRole, k: int) -> list[tuple[int, int, float]]:
    """The ``k`` heads with the highest score for ``role``: (layer, head, score), best first."""
    found = [
        (layer, head, float(value))
        for layer, per_role in scores.items()
        if role in per_role
        for head, value in enumerate(per_role[role].tolist())
    ]
    found.sort(key=lambda item: (-item[2], item[0], item[1]))
    return found[:k]


def copy_losses(logits: Tensor, input_ids: Tensor, *, start: int, repeat_length: int) -> tuple[float, float]:
    """Next-token loss (nats) on the first and on the second copy of a probe; (B, T, V), (B, T) -> (first, second).

    Targets are the copies' tokens after their first (the first token of a copy cannot be predicted from the
    copy): positions ``start+1 .. start+N-1`` and ``start+N+1 .. start+2N-1``. An induction mechanism makes the
    second much lower than the first, which is random tokens and near ``log(vocab)``.
    """
    losses = next_token_losses(logits, input_ids)  # (B, T-1): entry t-1 is the loss of token t
    n = repeat_length

    def mean_loss(first_target: int) -> float:
        targets = torch.arange(first_target, first_target + n - 1, device=losses.device)  # (N-1,)
        return float(losses[:, targets - 1].mean())

    return mean_loss(start + 1), mean_loss(start + n + 1)
