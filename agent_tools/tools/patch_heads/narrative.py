"""patch_heads' words: the summary and findings, from the fractions the plan measured."""

from __future__ import annotations

from dataclasses import dataclass

from agent_tools.schemas import Finding, head_label
from agent_tools.tools.patch_heads.models import HeadPatchResult, HeadPositions, LayerPatchResult

POSITIONS_SHOWN = 3


@dataclass(frozen=True)
class Patched:
    """What was patched and the logit differences it is measured against."""

    answer: str
    wrong: str
    clean: float  # LD clean
    corrupted: float  # LD corrupted
    heads: int  # heads patched
    top: list[HeadPatchResult]
    layers: list[LayerPatchResult]
    positions: list[HeadPositions]


def _head(result: HeadPatchResult) -> str:
    return f"L{result.layer}H{result.head}"


def _positions_text(item: HeadPositions, tokens_first: int = POSITIONS_SHOWN) -> str:
    ranked = sorted(item.positions, key=lambda p: -abs(p.restored))[:tokens_first]
    shown = ", ".join(f"{p.position} {p.token!r} ({p.restored:.0%})" for p in ranked if abs(p.restored) >= 0.005)
    return f"L{item.layer}H{item.head} at {shown}" if shown else f"L{item.layer}H{item.head} at no single position"


def summary(numbers: Patched) -> str:
    """The logit differences, the heads that restore most, the layers, and where the top heads act."""
    top = numbers.top[0]
    rest = numbers.top[1:]
    text = (
        f"Logit difference {numbers.answer!r} − {numbers.wrong!r}: {numbers.clean:.3f} clean, {numbers.corrupted:.3f} "
        f"corrupted. Copying one head's clean output into the corrupted run, {_head(top)} restores {top.restored:+.1%} "
        "of it (negative: pushes it the other way)"
    )
    if rest:
        text += "; then " + ", ".join(f"{_head(r)} {r.restored:+.1%}" for r in rest)
    text += f" (of {numbers.heads} heads patched)."
    layers = sorted(numbers.layers, key=lambda r: -abs(r.restored))[:3]
    text += " By layer (all its heads at once): " + ", ".join(f"{r.layer} {r.restored:+.1%}" for r in layers) + "."
    if numbers.positions:
        text += " Per position: " + "; ".join(_positions_text(p) for p in numbers.positions) + "."
    return text


def findings(numbers: Patched) -> list[Finding]:
    """One finding per top head, the layer that restores most, and where the top head acts."""
    rows = [
        Finding(
            kind="restores",
            layer=r.layer,
            head=r.head,
            value=r.restored,
            detail=f"patching {head_label(r.layer, r.head)} restores {r.restored:.1%} of the logit difference "
            f"{numbers.answer!r} − {numbers.wrong!r} (LD {r.logit_difference:.3f})",
        )
        for r in numbers.top
    ]
    best = max(numbers.layers, key=lambda r: abs(r.restored))
    rows.append(
        Finding(
            kind="layer_restores",
            layer=best.layer,
            value=best.restored,
            detail=f"all heads of layer {best.layer} together restore {best.restored:.1%}",
        )
    )
    for item in numbers.positions[:1]:
        peak = max(item.positions, key=lambda p: abs(p.restored))
        rows.append(
            Finding(
                kind="restoring_position",
                layer=item.layer,
                head=item.head,
                position=peak.position,
                token=peak.token,
                value=peak.restored,
                detail=f"L{item.layer}H{item.head} restores most at position {peak.position} {peak.token!r} "
                f"({peak.restored:.1%})",
            )
        )
    return rows
