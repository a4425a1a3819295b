"""Head roles: what each attention head does, as attention shares with documented formulas — a registry.

A role is data: a :class:`Role` in :data:`ROLES` with its kernel (which keys it reads from each query), threshold,
formula and ablation check. ``A`` is one head's map, rows are queries ``i``, columns keys ``j``, ``T`` the sequence
length. Every kernel role scores the same way (:class:`KeyPattern`, and a user's own pattern through
:class:`DensePattern`):

    share_i = Σ_j A[i, j] · P[i, j],   score = mean of share_i over the scored rows,

where ``P`` is the role's key pattern (1 on the keys it reads) and the scored rows are the queries
``i ≥ skip_queries`` that may read at least one key of the pattern (early causal rows see one or two keys, so
their shares say nothing about the head). ``broad`` is the one role that is not a share: the mean normalised
entropy. So every score lies in [0, 1] and is comparable across heads and models.

Text roles are measured on texts (the user's text, or the built-in sample, and held-out texts); probe roles on
``[BOS] r₁ … r_N r₁ … r_N``, ``N`` random distinct tokens repeated once (:mod:`agent_tools.probes`). Each role's
formula is its registry entry's ``formula``; a new role is one ``HeadRole`` name and one :class:`Role` entry
(see docs/ARCHITECTURE.md, "How to add a head role").

Everything here is pure: tensors in, tensors or plain values out; inputs are never modified. The streamed sums
(``RoleAccumulator``, ``role_scores``, ``RoleScoreConsumer``, ``pattern_scores``) live in
:mod:`agent_tools.consumers.roles`.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal, Protocol, TypeVar, get_args

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
MeasuredOn = Literal["text", "probe"]
# What removing a head of the role should change, when the role predicts something measurable.
AblationCheck = Literal["probe_second_copy_loss"]
ABLATION_CHECKS: tuple[AblationCheck, ...] = get_args(AblationCheck)
ABLATION_CHECK_FORMULAS: dict[AblationCheck, str] = {
    "probe_second_copy_loss": "mean next-token loss on the seed-0 probe's second copy with the head mean-ablated "
    "(its output replaced by its mean over the probe's positions) minus the clean loss, nats; copying the second "
    "copy needs induction, and induction finds what to copy through a previous-token head's write",
}

DEFAULT_SKIP_CAUSAL = 2  # early causal rows see 1–2 keys: their shares are forced, not chosen
DEFAULT_LOCAL_WINDOW = 4


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
        """Whether the role can be scored on this sequence at all (its kernel exists here, two tokens or more)."""
        kernel = ROLES[role].kernel
        return self.length >= 2 and (kernel is None or kernel(self) is not None)


# --- key patterns: which keys a role (or a user's pattern) reads from each query ------------------------------


def diagonal(x: Tensor, rows: Tensor, offset: int, *, min_key: int = 0) -> Tensor:
    """(..., q, k) -> (..., q): ``x[..., r, rows[r] + offset]``, 0 where that key is outside ``min_key..k-1``."""
    keys = x.shape[-1]
    target = rows + offset  # (q,)
    valid = (target >= min_key) & (target < keys)
    index = target.clamp(0, keys - 1).view(*([1] * (x.dim() - 2)), -1, 1).expand(*x.shape[:-1], 1)  # (..., q, 1)
    return torch.gather(x, -1, index).squeeze(-1) * valid.to(x.dtype)


class KeyReader(Protocol):
    """A query × key pattern ``P`` that can read ``Σ_j x[..., i, j] · P[i, j]`` for a block of query rows."""

    def read(self, x: Tensor, rows: Tensor) -> Tensor:
        """(..., q, k) float, (q,) absolute query positions -> (..., q)."""
        ...

    def dense(self, rows: Tensor, keys: int) -> Tensor:
        """(q,) absolute query positions -> (q, k) float: the pattern itself on those rows."""
        ...


@dataclass(frozen=True)
class KeyPattern:
    """A pattern built from structure the scorer reads in O(q) per row block instead of a dense (q, k) kernel.

    ``P[i, j]`` is the sum of: 1 for every offset ``d`` with ``j = i + d ≥ min_key``; 1 for ``j = 0`` when
    ``first_token`` and ``i ≥ 1``; 1 for a flagged key ``j ≥ 1, j ≠ i``; all of it 0 outside the query rows
    ``rows = (lo, hi)`` (``lo ≤ i < hi``; None = every row).
    """

    offsets: tuple[int, ...] = ()
    min_key: int = 0
    first_token: bool = False
    flags: tuple[bool, ...] = ()
    rows: tuple[int, int] | None = None

    def row_mask(self, rows: Tensor) -> Tensor:
        """(q,) positions -> (q,) bool: the query rows the pattern is defined on."""
        if self.rows is None:
            return torch.ones_like(rows, dtype=torch.bool)
        low, high = self.rows
        return (rows >= low) & (rows < high)

    def _flags(self, keys: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        flags = torch.zeros(keys, dtype=dtype, device=device)  # (k,) columns past the flags (a key prefix): 0
        known = min(keys, len(self.flags))
        flags[:known] = torch.tensor(self.flags[:known], dtype=dtype, device=device)
        flags[0] = 0  # the first token is first_token's
        return flags

    def read(self, x: Tensor, rows: Tensor) -> Tensor:
        total = x.new_zeros(x.shape[:-1])  # (..., q)
        for offset in self.offsets:
            total = total + diagonal(x, rows, offset, min_key=self.min_key)
        if self.first_token:
            total = total + x[..., 0] * (rows >= 1).to(x.dtype)
        if self.flags:
            keys = x.shape[-1]
            flags = self._flags(keys, x.device, x.dtype)
            own = flags[rows.clamp(0, keys - 1)] * (rows < keys).to(x.dtype)  # (q,) the row's own key (j ≠ i)
            total = total + x @ flags - diagonal(x, rows, 0) * own
        return total * self.row_mask(rows).to(x.dtype)

    def dense(self, rows: Tensor, keys: int) -> Tensor:
        i = rows[:, None]  # (q, 1)
        j = torch.arange(keys, device=rows.device)[None, :]  # (1, k)
        pattern = torch.zeros(len(rows), keys, device=rows.device)  # (q, k)
        for offset in self.offsets:
            pattern += ((j == i + offset) & (j >= self.min_key)).float()
        if self.first_token:
            pattern += ((j == 0) & (i >= 1)).float()
        if self.flags:
            flags = self._flags(keys, rows.device, torch.float32).bool()
            pattern += (flags[None, :] & (j != i)).float()
        return pattern * self.row_mask(rows)[:, None].float()


@dataclass(frozen=True, eq=False)
class DensePattern:
    """A user's pattern as a (T, T) tensor of weights in [0, 1] (bool for a mask): ``P[i, j]`` as given.

    Queries and keys past ``T`` get 0 (a pattern is made for one sequence length).
    """

    weights: Tensor

    def __post_init__(self) -> None:
        w = self.weights
        if w.dim() != 2 or w.shape[0] != w.shape[1]:
            raise ValueError(f"a pattern is a (T, T) query × key tensor, got shape {tuple(w.shape)}")
        values = w.float()
        if not bool(torch.isfinite(values).all()) or float(values.min()) < 0 or float(values.max()) > 1:
            raise ValueError("a pattern's weights must lie in [0, 1]")

    def dense(self, rows: Tensor, keys: int) -> Tensor:
        size = self.weights.shape[0]
        block = torch.zeros(len(rows), keys, device=rows.device)  # (q, k)
        inside = rows < size
        width = min(keys, size)
        block[inside, :width] = self.weights.to(rows.device)[rows[inside]][:, :width].float()
        return block

    def read(self, x: Tensor, rows: Tensor) -> Tensor:
        return (x * self.dense(rows, x.shape[-1]).to(x.dtype)).sum(-1)  # (..., q)


# --- the registry -------------------------------------------------------------------------------------------

RoleKernel = Callable[[SequenceLayout], KeyPattern | None]  # None: the role is not measurable on this sequence


@dataclass(frozen=True)
class Role:
    """One head role: how it is scored, when a head takes it, and what removing such a head should change.

    ``kernel`` gives the role's :class:`KeyPattern` on a sequence (None there: not measurable); a role without a
    kernel (``broad``) is the mean normalised entropy instead. ``threshold``: the score a head needs to take the
    role. ``ablation_check``: the measurement that could refute "this head is a <role> head" (None: the role
    predicts no behavioural effect to test). ``fallback``: what a head does when its own pattern is absent
    (primary only when no specific role qualifies).
    """

    name: HeadRole
    kernel: RoleKernel | None
    threshold: float
    formula: str
    ablation_check: AblationCheck | None = None
    measured_on: MeasuredOn = "text"
    fallback: bool = False

    def pattern(self, layout: SequenceLayout) -> KeyPattern | None:
        """The role's key pattern on ``layout`` (None: no kernel, or none on this sequence)."""
        return self.kernel(layout) if self.kernel is not None else None


def _next_token(layout: SequenceLayout) -> KeyPattern | None:
    return None if layout.causal else KeyPattern(offsets=(1,))  # a causal row cannot see i+1


def _local(layout: SequenceLayout) -> KeyPattern:
    window = layout.local_window
    return KeyPattern(offsets=tuple(d for d in range(-window, window + 1) if abs(d) >= 2), min_key=1)


def _flagged(flags: tuple[bool, ...]) -> KeyPattern | None:
    return KeyPattern(flags=flags) if any(flags[1:]) else None


def _copy_offset(layout: SequenceLayout, offset: int) -> KeyPattern | None:
    """Second-copy queries reading ``i − N + offset`` (``offset`` 1: the token after the earlier copy)."""
    if layout.repeat is None:
        return None
    start, n = layout.repeat
    return KeyPattern(offsets=(offset - n,), rows=(start + n, start + 2 * n))


# A head takes a role when its score reaches the role's threshold (each a share of attention, broad a share of
# the maximum entropy), chosen so that a head putting clearly more than chance on the pattern qualifies.
ROLES: dict[HeadRole, Role] = {
    role.name: role
    for role in (
        Role(
            "previous_token",
            lambda _layout: KeyPattern(offsets=(-1,)),
            0.4,
            "mean A[i, i-1] over queries i >= max(1, skip)",
            ablation_check="probe_second_copy_loss",
        ),
        Role(
            "induction",
            partial(_copy_offset, offset=1),
            0.3,
            "probe: mean A[i, i-N+1] over queries i in the second copy (token after the earlier copy)",
            ablation_check="probe_second_copy_loss",
            measured_on="probe",
        ),
        Role(
            "duplicate_token",
            partial(_copy_offset, offset=0),
            0.3,
            "probe: mean A[i, i-N] over queries i in the second copy (the earlier copy itself)",
            measured_on="probe",
        ),
        Role(
            "first_token",
            lambda _layout: KeyPattern(first_token=True),
            0.5,
            "mean A[i, 0] over queries i >= max(1, skip) (first-token / attention-sink share)",
            fallback=True,
        ),
        Role("self", lambda _layout: KeyPattern(offsets=(0,)), 0.3, "mean A[i, i] over queries i >= skip"),
        Role(
            "local",
            _local,
            0.5,
            "mean of sum A[i, j] over 2 <= |i-j| <= window, j >= 1, over queries i >= skip that can read such a key",
        ),
        Role(
            "broad",
            None,
            0.8,
            "mean entropy(A[i]) / log(visible keys) over queries i >= skip seeing >= 2 keys",
            fallback=True,
        ),
        Role("next_token", _next_token, 0.4, "mean A[i, i+1] over queries i >= skip (bidirectional models only)"),
        Role(
            "special_token",
            lambda layout: _flagged(layout.special),
            0.3,
            "mean of sum A[i, j] over special keys j >= 1, j != i, over queries that can see one",
        ),
        Role(
            "punctuation",
            lambda layout: _flagged(layout.punctuation),
            0.3,
            "mean of sum A[i, j] over punctuation keys j >= 1, j != i, over queries that can see one",
        ),
    )
}
PROBE_ROLES: tuple[HeadRole, ...] = tuple(r for r in HEAD_ROLES if ROLES[r].measured_on == "probe")
TEXT_ROLES: tuple[HeadRole, ...] = tuple(r for r in HEAD_ROLES if ROLES[r].measured_on == "text")
FALLBACK_ROLES: tuple[HeadRole, ...] = tuple(r for r in HEAD_ROLES if ROLES[r].fallback)
DEFAULT_THRESHOLDS: dict[HeadRole, float] = {r: ROLES[r].threshold for r in HEAD_ROLES}


# --- named patterns: what an agent may ask profile_heads to score (no code from agents) ----------------------

PatternName = Literal[
    "previous_token", "next_token", "self", "first_token", "local_window", "same_token", "after_same_token"
]


@dataclass(frozen=True)
class NamedPattern:
    """A pattern an agent names: ``build(layout, input_ids)`` gives its reader on a sequence (None: no key of the
    pattern exists there)."""

    name: PatternName
    formula: str
    build: Callable[[SequenceLayout, Tensor], KeyReader | None]


def _role_pattern(role: HeadRole) -> Callable[[SequenceLayout, Tensor], KeyReader | None]:
    return lambda layout, _input_ids: ROLES[role].pattern(layout)


def _local_window(layout: SequenceLayout, input_ids: Tensor) -> KeyReader:
    window = layout.local_window
    return KeyPattern(offsets=tuple(d for d in range(-window, window + 1) if d != 0))


def same_token_mask(input_ids: Tensor) -> Tensor:
    """(T,) ids -> (T, T) bool: key j holds the query's token, ``j ≠ i``."""
    same = input_ids[:, None] == input_ids[None, :]  # (T, T)
    return same & ~torch.eye(len(input_ids), dtype=torch.bool, device=input_ids.device)


def after_same_token_mask(input_ids: Tensor) -> Tensor:
    """(T,) ids -> (T, T) bool: key j follows an earlier copy of the query's token (``ids[j−1] = ids[i]``,
    ``j ≥ 1``, ``j − 1 ≠ i``): TransformerLens' induction pattern, on any text with repeats."""
    mask = torch.zeros(len(input_ids), len(input_ids), dtype=torch.bool, device=input_ids.device)  # (T, T)
    mask[:, 1:] = same_token_mask(input_ids)[:, :-1]
    return mask


def _from_mask(make: Callable[[Tensor], Tensor]) -> Callable[[SequenceLayout, Tensor], KeyReader | None]:
    def build(layout: SequenceLayout, input_ids: Tensor) -> KeyReader | None:
        mask = make(input_ids)
        return DensePattern(mask) if bool(mask.any()) else None

    return build


NAMED_PATTERNS: dict[PatternName, NamedPattern] = {
    pattern.name: pattern
    for pattern in (
        NamedPattern("previous_token", "the previous_token role's kernel: key i-1", _role_pattern("previous_token")),
        NamedPattern("next_token", "the next_token role's kernel: key i+1 (encoders)", _role_pattern("next_token")),
        NamedPattern("self", "the self role's kernel: key i", _role_pattern("self")),
        NamedPattern("first_token", "the first_token role's kernel: key 0 for i >= 1", _role_pattern("first_token")),
        NamedPattern("local_window", "keys 1..local_window positions away, either side", _local_window),
        NamedPattern("same_token", "keys holding the query's own token, j != i", _from_mask(same_token_mask)),
        NamedPattern(
            "after_same_token",
            "keys right after an earlier copy of the query's token (induction pattern on the text)",
            _from_mask(after_same_token_mask),
        ),
    )
}


def user_pattern(pattern: Tensor | Callable[[Tensor], Tensor], input_ids: Tensor) -> DensePattern:
    """A Python user's pattern on one sequence: a (T, T) tensor, or a function of the (T,) token ids returning one
    (positions are ``arange(T)``); weights in [0, 1]. Only Python callers can pass a function: agents name patterns."""
    weights = pattern(input_ids) if callable(pattern) else pattern
    if weights.shape[-1] != len(input_ids):
        raise ValueError(f"pattern is {tuple(weights.shape)} for a sequence of {len(input_ids)} tokens")
    return DensePattern(weights)


# --- classification -----------------------------------------------------------------------------------------


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

    The fallback roles (``first_token``, ``broad``) are what a head does when its own pattern is absent (it parks
    on the sink or spreads out), so they are primary only when no specific role qualifies: an induction head that
    rests on the first token of ordinary text is still an induction head. Confidence is the primary role's
    strength ``(score − τ) / (1 − τ)`` in [0, 1] (0 = just at the threshold, 1 = a perfect score); the runner-up is
    the next role in the same order (qualifying specific, qualifying fallback, then the rest by strength).
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


RoleVerdict = Literal["is_role", "attends_only", "unchecked", "below_threshold"]


def role_verdict(score: float, threshold: float, *, checked: bool | None) -> RoleVerdict:
    """What may be said of a top head: ``is_role`` only when its score reaches the threshold *and* its ablation
    check ran and exceeded the random-head baseline (``checked`` True); ``attends_only`` when the check ran and did
    not; ``unchecked`` when no check ran (the role has none, or the model has no next-token head)."""
    if score < threshold:
        return "below_threshold"
    if checked is None:
        return "unchecked"
    return "is_role" if checked else "attends_only"


Name = TypeVar("Name", bound=str)  # a role or a pattern name


def top_heads(scores: Mapping[int, Mapping[Name, Tensor]], role: Name, k: int) -> list[tuple[int, int, float]]:
    """The ``k`` heads with the highest score for ``role`` (or pattern): (layer, head, score), best first."""
    found = [
        (layer, head, float(value))
        for layer, per_role in scores.items()
        if role in per_role
        for head, value in enumerate(per_role[role].tolist())
    ]
    found.sort(key=lambda item: (-item[2], item[0], item[1]))
    return found[:k]


def copy_losses(logits: Tensor, input_ids: Tensor, *, start: int, repeat_length: int) -> tuple[float, float]:
    """Next-token loss (nats) on the first and on the second copy of a probe; (B, T, V), (1 or B, T) -> (first,
    second).

    Targets are the copies' tokens after their first (the first token of a copy cannot be predicted from the
    copy): positions ``start+1 .. start+N-1`` and ``start+N+1 .. start+2N-1``. An induction mechanism makes the
    second much lower than the first, which is random tokens and near ``log(vocab)``. With B > 1 rows the mean is
    over the rows too (:func:`copy_losses_from` keeps them apart).
    """
    ids = input_ids.to(logits.device).expand(logits.shape[0], -1)  # (B, T)
    losses = next_token_losses(logits, ids)  # (B, T-1): entry t-1 is the loss of token t
    first, second = copy_losses_from(losses, start=start, repeat_length=repeat_length)
    return float(first.mean()), float(second.mean())


def copy_losses_from(losses: Tensor, *, start: int, repeat_length: int) -> tuple[Tensor, Tensor]:
    """(B, T−1) next-token losses (entry t−1: the loss of token t) -> (B,) first- and (B,) second-copy means
    (:func:`copy_losses`' targets)."""
    n = repeat_length

    def mean_loss(first_target: int) -> Tensor:
        targets = torch.arange(first_target, first_target + n - 1, device=losses.device)  # (N-1,)
        return losses[:, targets - 1].mean(-1)

    return mean_loss(start + 1), mean_loss(start + n + 1)
