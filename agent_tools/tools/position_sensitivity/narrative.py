"""position_sensitivity's words: the curve's shape, best and worst position, from the measured log-probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent_tools.schemas import Finding

FLAT_NATS = 0.05  # a spread below this is called flat


def curve_shape(logprobs: Sequence[float]) -> str:
    """``flat`` (spread < 0.05 nats), ``u_shaped`` (both ends above every middle position), else ``other``."""
    if max(logprobs) - min(logprobs) < FLAT_NATS:
        return "flat"
    if len(logprobs) >= 3 and min(logprobs[0], logprobs[-1]) > max(logprobs[1:-1]):
        return "u_shaped"
    return "other"


@dataclass(frozen=True)
class CurveNumbers:
    moved: str
    answer: str
    slots: Sequence[int]
    logprobs: Sequence[float]
    shares: Sequence[float]
    best: int
    worst: int
    last_slot: int


def _where(slot: int, last: int) -> str:
    return "first" if slot == 0 else "last" if slot == last else f"slot {slot} of 0..{last}"


def summary(n: CurveNumbers) -> str:
    shape = curve_shape(n.logprobs)
    words = {
        "flat": "the answer hardly depends on where it sits",
        "u_shaped": "a U-curve: both ends beat every middle position",
        "other": "not a U-curve",
    }[shape]
    best, worst = n.logprobs[n.slots.index(n.best)], n.logprobs[n.slots.index(n.worst)]
    return (
        f"Moving {n.moved!r} through {len(n.slots)} positions: log p({n.answer!r}) is best "
        f"{_where(n.best, n.last_slot)} ({best:.3f}) and worst {_where(n.worst, n.last_slot)} ({worst:.3f}), spread "
        f"{best - worst:.3f} nats — {words}. "
        f"Attention on the segment ranges {min(n.shares):.3f}..{max(n.shares):.3f}."
    )


def findings(n: CurveNumbers) -> list[Finding]:
    return [
        Finding(
            kind="position_effect",
            severity="high" if slot in (n.best, n.worst) else "low",
            value=logprob,
            detail=f"{n.moved!r} at {_where(slot, n.last_slot)}: log p(answer) {logprob:.3f}, attention share "
            f"{share:.3f}",
        )
        for slot, logprob, share in zip(n.slots, n.logprobs, n.shares, strict=True)
    ]
