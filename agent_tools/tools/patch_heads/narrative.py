"""patch_heads' words: the summary and findings, from the fractions the plan measured."""

from __future__ import annotations

from dataclasses import dataclass

from agent_tools.schemas import Finding, head_label
from agent_tools.tools.patch_heads.models import (
    AttributionCheck,
    Baseline,
    HeadPatchResult,
    HeadPositions,
    PatchReport,
    SetPatch,
)
from agent_tools.wording import head_name, head_names

POSITIONS_SHOWN = 3
NO_CHANGE = 0.005  # |restored| below half a percent moves the logit difference neither way


@dataclass(frozen=True)
class Patched:
    """The report, and what its words read that it does not state so: the logit differences unrounded and how many
    heads were patched (exactly or by estimate)."""

    report: PatchReport
    clean: float  # LD clean
    corrupted: float  # LD corrupted
    heads: int  # heads patched

    def toward(self, restored: float) -> str:
        """The direction of a restored fraction in words."""
        if abs(restored) < NO_CHANGE:
            return "no measurable change"
        if restored > 0:
            return f"toward {self.report.answer!r}"
        return f"the other way, toward {self.report.wrong!r}"


def _spread(reference: Baseline) -> str:
    return f"{reference.mean:+.1%} ± {reference.spread:.1%}"


def _sized(numbers: Patched, result: HeadPatchResult) -> str:
    """'large: one random head restores +0.1% ± 0.4% (261 heads)'."""
    single = numbers.report.single_head_baseline
    return f"{result.size}: one random head {_spread(single)}, {single.draws} heads"


def _set_text(numbers: Patched, top_set: SetPatch) -> str:
    reference = top_set.baseline
    text = (
        f"The top {len(top_set.heads)} together restore {top_set.restored:+.1%} ({numbers.toward(top_set.restored)}; "
        f"{top_set.size} against {reference.draws} random sets of {reference.heads} heads: {_spread(reference)})"
    )
    if top_set.change == "unchanged":
        return text + f"; the top token stays {top_set.top_token_corrupted!r}."
    word = "flips" if top_set.change == "flip" else "ties"
    return (
        text + f"; the top token {word}: {top_set.top_token_corrupted!r} → {top_set.top_token_patched!r} (p "
        f"{top_set.p_old:.3f} → {top_set.p_new:.3f}{', within the tie margin' if word == 'ties' else ''})."
    )


def _attribution_text(check: AttributionCheck) -> str:
    rho = f"rank agreement ρ {check.spearman:.2f}" if check.spearman is not None else "no rank agreement"
    missed = (
        f"; largest exact effect outside the candidates {_head(check.missed)} {check.missed.restored:+.1%}"
        if check.missed is not None
        else ""
    )
    saturated = (
        f"; AtP* recomputed the saturated softmax of {head_names(check.saturated, 4)}" if check.saturated else ""
    )
    return (
        f" Ranked by attribution patching ({check.estimated} heads estimated by gradients{saturated}; "
        f"{check.verified_top} "
        f"candidates and {check.verified_random} random heads patched exactly, only exact values reported; {rho}; "
        f"the estimate's top {check.k} holds {check.recall} of the exact top {check.k}{missed})."
    )


def _head(result: HeadPatchResult | HeadPositions) -> str:
    return head_name(result.layer, result.head)


def _positions_text(item: HeadPositions, tokens_first: int = POSITIONS_SHOWN) -> str:
    ranked = sorted(item.positions, key=lambda p: -abs(p.restored))[:tokens_first]
    shown = ", ".join(f"{p.position} {p.token!r} ({p.restored:.0%})" for p in ranked if abs(p.restored) >= NO_CHANGE)
    return f"{_head(item)} at {shown or 'no single position'}"


def summary(numbers: Patched) -> str:
    """The logit differences, the heads that restore most, the layers, and where the top heads act."""
    report = numbers.report
    top, rest = report.top_heads[0], report.top_heads[1:]
    text = (
        f"Logit difference {report.answer!r} − {report.wrong!r}: {numbers.clean:.3f} clean, {numbers.corrupted:.3f} "
        f"corrupted. Copying one head's clean output into the corrupted run, {_head(top)} restores {top.restored:+.1%} "
        f"of it, {numbers.toward(top.restored)} ({_sized(numbers, top)})"
    )
    if rest:
        text += "; then " + ", ".join(f"{_head(r)} {r.restored:+.1%} ({r.size})" for r in rest)
    text += f" (of {numbers.heads} heads)."
    if report.top_set is not None:
        text += " " + _set_text(numbers, report.top_set)
    else:
        text += " Too few other heads to draw random sets of the same size: the top set is not sized."
    if report.attribution is not None:
        text += _attribution_text(report.attribution)
    layers = sorted(report.layer_results, key=lambda r: -abs(r.restored))[:3]
    text += " By layer (all its heads at once): " + ", ".join(f"{r.layer} {r.restored:+.1%}" for r in layers) + "."
    if report.positions:
        text += " Per position: " + "; ".join(_positions_text(p) for p in report.positions) + "."
    return text


def findings(numbers: Patched) -> list[Finding]:
    """One finding per top head, the layer that restores most, and where the top head acts."""
    report = numbers.report
    rows = [
        Finding(
            kind="restores",
            layer=r.layer,
            head=r.head,
            value=r.restored,
            severity="high" if r.size == "large" else "low",
            detail=f"patching {head_label(r.layer, r.head)} restores {r.restored:+.1%} of the logit difference "
            f"{report.answer!r} − {report.wrong!r}, {numbers.toward(r.restored)} (LD {r.logit_difference:.3f}; "
            f"{_sized(numbers, r)})" + (f"; attribution estimated {r.estimate:+.1%}" if r.estimate is not None else ""),
        )
        for r in report.top_heads
    ]
    if report.top_set is not None:
        rows.append(Finding(kind="top_set", value=report.top_set.restored, detail=_set_text(numbers, report.top_set)))
    best = max(report.layer_results, key=lambda r: abs(r.restored))
    rows.append(
        Finding(
            kind="layer_restores",
            layer=best.layer,
            value=best.restored,
            detail=f"all heads of layer {best.layer} together restore {best.restored:+.1%}, "
            f"{numbers.toward(best.restored)}",
        )
    )
    for item in report.positions[:1]:
        peak = max(item.positions, key=lambda p: abs(p.restored))
        rows.append(
            Finding(
                kind="restoring_position",
                layer=item.layer,
                head=item.head,
                position=peak.position,
                token=peak.token,
                value=peak.restored,
                detail=f"{_head(item)} restores most at position {peak.position} {peak.token!r} ({peak.restored:.1%})",
            )
        )
    if report.attribution is not None:
        check = report.attribution
        rows.append(
            Finding(
                kind="attribution_check",
                value=check.spearman,
                detail=_attribution_text(check).strip(" ().").removeprefix("Ranked by ") + f"; gradients in "
                f"{check.gradient_dtype}",
            )
        )
    return rows
