"""position_sensitivity's words: the curve's shape, best and worst position, from the measured log-probabilities."""

from __future__ import annotations

from collections.abc import Sequence

from agent_tools.schemas import Finding
from agent_tools.tools.position_sensitivity.models import PositionSensitivityReport

FLAT_NATS = 0.05  # a spread below this is called flat


def curve_shape(logprobs: Sequence[float]) -> str:
    """``flat`` (spread < 0.05 nats), ``u_shaped`` (both ends above every middle position), else ``other``."""
    if max(logprobs) - min(logprobs) < FLAT_NATS:
        return "flat"
    if len(logprobs) >= 3 and min(logprobs[0], logprobs[-1]) > max(logprobs[1:-1]):
        return "u_shaped"
    return "other"


def where(slot: int, last: int) -> str:
    """Where slot ``slot`` of 0..``last`` sits, in words: first, last, or its number."""
    return "first" if slot == 0 else "last" if slot == last else f"slot {slot} of 0..{last}"


def summary(report: PositionSensitivityReport) -> str:
    """The curve's shape, where the answer is likeliest and least likely, and the attention share's range."""
    logprobs = [p.answer_logprob for p in report.positions]
    shares = [p.attention_share for p in report.positions]
    by_slot = {p.slot: p.answer_logprob for p in report.positions}
    last = max(by_slot)  # the slots run from the first position to the last
    words = {
        "flat": "the answer hardly depends on where it sits",
        "u_shaped": "a U-curve: both ends beat every middle position",
        "other": "not a U-curve",
    }[report.shape]
    best, worst = by_slot[report.best_slot], by_slot[report.worst_slot]
    return (
        f"Moving {report.moved!r} through {len(logprobs)} positions: log p({report.answer!r}) is best "
        f"{where(report.best_slot, last)} ({best:.3f}) and worst {where(report.worst_slot, last)} ({worst:.3f}), "
        f"spread {best - worst:.3f} nats — {words}. Attention on the segment ranges "
        f"{min(shares):.3f}..{max(shares):.3f}."
    )


def findings(report: PositionSensitivityReport) -> list[Finding]:
    """One finding per position: the answer's log-probability and the segment's attention share there."""
    last = max(p.slot for p in report.positions)
    return [
        Finding(
            kind="position_effect",
            severity="high" if p.slot in (report.best_slot, report.worst_slot) else "low",
            value=p.answer_logprob,
            detail=f"{report.moved!r} at {where(p.slot, last)}: log p(answer) {p.answer_logprob:.3f}, attention share "
            f"{p.attention_share:.3f}",
        )
        for p in report.positions
    ]
