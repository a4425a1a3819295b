"""diagnose_collapse's words: the summary and findings, written from numbers the plan has already computed.

Pure functions of :class:`CollapseNumbers` and the rounded report rows, so the text can be read (and changed)
without running a model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from agent_tools.analysis.collapse import NO_OP_CONTRIBUTION, CollapseKind, Verdict
from agent_tools.schemas import Finding, NextCall, Severity, head_label, text_follow_up
from agent_tools.tools.diagnose_collapse.models import (
    AblationEffectRow,
    BaselineRow,
    CollapseCheck,
    CollapseCheckRow,
    CollapseReport,
    DiagnoseCollapseInput,
    GroupCheckRow,
    HeadCollapseRow,
)
from agent_tools.wording import head_name, random_heads


@dataclass(frozen=True)
class CollapseNumbers:
    """What the pass measured, as the report states it: every examined head's row, most collapsed first."""

    num_tokens: int
    rows: list[HeadCollapseRow]
    verdict_counts: dict[str, int]
    bound_violations: int  # rows, over every head, whose entropy fell below the Zhai et al. bound
    rows_counted: int  # rows, over every head, that the bound was checked on
    check: CollapseCheck | None = None  # what removing the collapsed heads does (None: not run)

    @property
    def concentrated(self) -> list[HeadCollapseRow]:
        """The heads with a verdict other than ``not_collapsed``, most collapsed first."""
        return [r for r in self.rows if r.verdict != "not_collapsed"]


# --- one sentence per verdict -----------------------------------------------------------------------------


def _where(row: HeadCollapseRow | CollapseCheckRow) -> str:
    return head_name(row.layer, row.head)


def _onto(row: HeadCollapseRow) -> str:
    return f"token {row.dominant_position} {row.dominant_token!r}"


def _weight(row: HeadCollapseRow) -> str:
    return f"mean max weight {row.mean_max_weight:.3f}, {row.saturated_fraction:.0%} of rows ≥ threshold"


def _value_side(row: HeadCollapseRow) -> str:
    """The value-side evidence behind a sink/collapse verdict ('' when the model gave no value norms)."""
    if row.contribution_ratio is None or row.dominant_contribution is None or row.other_value_norm is None:
        return ""
    return (
        f"; ‖α·v W_O‖ of that key is {row.dominant_contribution:.3g} vs {row.other_value_norm:.3g} for an ordinary "
        f"key's ‖v W_O‖ (ratio {row.contribution_ratio:.2f})"
    )


def _no_op_sink(row: HeadCollapseRow) -> str:
    return (
        f"{_where(row)} sinks {row.dominant_share:.0%} of its weight onto {_onto(row)} ({_weight(row)}) but is a "
        f"no-op: it writes almost nothing{_value_side(row)}"
    )


def _writing_collapse(row: HeadCollapseRow) -> str:
    return (
        f"{_where(row)} collapses onto {_onto(row)} whatever the query ({_weight(row)}) and that key's value is "
        f"substantial{_value_side(row)}: the head writes about the same vector at every position (value norms "
        "only: not evidence that it matters)"
    )


def _positional_key(row: HeadCollapseRow) -> str:
    """What a positional head reads: itself or the previous token."""
    return "itself" if row.concentration == "self" else "the previous token"


def _positional(row: HeadCollapseRow) -> str:
    frac = row.self_fraction if row.concentration == "self" else row.previous_fraction
    return (
        f"{_where(row)} attends to {_positional_key(row)} on {frac:.0%} of rows ({_weight(row)}): "
        "a positional head, not a failure"
    )


def _query_dependent(row: HeadCollapseRow) -> str:
    return f"{_where(row)} is sharp ({_weight(row)}) but its chosen key changes with the query"


def _not_collapsed(row: HeadCollapseRow) -> str:
    return (
        f"{_where(row)} is not collapsed: mean entropy {row.mean_entropy:.3f} nats ({row.mean_normalised_entropy:.0%} "
        f"of uniform), mean max weight {row.mean_max_weight:.3f}"
    )


_DESCRIBE: dict[Verdict, Callable[[HeadCollapseRow], str]] = {
    "no_op_sink": _no_op_sink,
    "writing_collapse": _writing_collapse,
    "positional": _positional,
    "query_dependent": _query_dependent,
    "not_collapsed": _not_collapsed,
}


def describe(row: HeadCollapseRow) -> str:
    """One sentence on one head, by its verdict."""
    return _DESCRIBE[row.verdict](row)


# --- findings ---------------------------------------------------------------------------------------------


# Value-side verdicts never decide severity on their own: a positional or query-dependent head is worth a look, a
# collapse is low until its removal is measured (then KINDS says how much it matters).
SEVERITY: dict[Verdict, Severity] = {
    "writing_collapse": "low",
    "positional": "medium",
    "query_dependent": "medium",
    "no_op_sink": "low",
    "not_collapsed": "low",
}


class _Kind(NamedTuple):
    severity: Severity
    words: str  # "L24H6 is {words}"
    plural: str  # "3 more {plural}"
    moved: bool  # removing the head moved the loss beyond chance


# In the order the checked heads are reported: those whose removal moved the loss first.
KINDS: dict[CollapseKind, _Kind] = {
    "harmful": _Kind("high", "harmful", "harmful", moved=True),
    "load_bearing": _Kind("medium", "load-bearing", "load-bearing", moved=True),
    "mixed": _Kind("medium", "mixed (the two ablations disagree)", "mixed", moved=True),
    "constant_output": _Kind("low", "a constant-output head", "constant-output heads", moved=False),
    "no_op_sink": _Kind("low", "a no-op sink", "no-op sinks", moved=False),
}
MAX_NAMED = 12  # checked heads named in the findings (all of them, up to this many)


def _effect(value: float, unit: str) -> str:
    return f"{value:+.4f}{unit}"


def _baseline_text(baseline: BaselineRow | None, method: str, unit: str) -> str:
    if baseline is None:
        return "no baseline"
    pair = baseline.mean_ablation if method == "mean" else baseline.resample_ablation
    if pair is None:
        return "no baseline"
    return f"{random_heads(baseline.draws, baseline.heads_per_draw)}: {pair[0]:+.4f} ± {pair[1]:.4f}{unit}"


def _unit(check: CollapseCheck) -> str:
    return " nats" if check.measure == "next_token_loss" else " (1 − cos)"


def _moved(row: CollapseCheckRow | GroupCheckRow) -> AblationEffectRow | None:
    """The ablation (mean or resample) that moved the measure most beyond chance; None when both stayed within."""
    moved = [e for e in (row.mean_ablation, row.resample_ablation) if e is not None and e.direction != "within"]
    return max(moved, key=lambda x: abs(x.effect)) if moved else None


def _effects(row: CollapseCheckRow | GroupCheckRow, unit: str) -> str:
    """'mean-ablation +0.0001 nats, resample −0.0003'."""
    resample = f", resample {_effect(row.resample_ablation.effect, '')}" if row.resample_ablation else ""
    return f"mean-ablation {_effect(row.mean_ablation.effect, unit)}{resample}"


def check_sentence(row: CollapseCheckRow, check: CollapseCheck, *, baseline: bool = True) -> str:
    """'L24H6 is a constant-output head (mean-ablation +0.0001 nats, resample −0.0003; 8 random heads:
    0.0000 ± 0.0020)', and which way the loss moves when the head is removed, for the kinds that moved it."""
    unit = _unit(check)
    chance = f"; {_baseline_text(check.baseline, 'mean', unit)}" if baseline else ""
    moved = _moved(row) if check.measure == "next_token_loss" else None
    way = "" if moved is None else f"; removing it {moved.direction} the loss by {abs(moved.effect):.4f}{unit}"
    return f"{_where(row)} is {KINDS[row.kind].words} ({_effects(row, unit)}{chance}){way}"


def together_sentence(check: CollapseCheck) -> str:
    """'Removing all 8 together: mean-ablation −0.0143 nats, resample −0.0070 (8 random sets of 8 heads: ...) —
    within chance'."""
    row = check.together
    if row is None:
        return ""
    unit, moved = _unit(check), _moved(row)
    if moved is None:
        verdict = "within chance"
    else:
        verdict = f"{moved.direction} the loss beyond chance" if check.measure == "next_token_loss" else "beyond chance"
    return (
        f"Removing all {check.checked} together: {_effects(row, unit)} "
        f"({_baseline_text(check.together_baseline, 'mean', unit)}) — {verdict}."
    )


def check_finding(row: CollapseCheckRow, check: CollapseCheck, heads: dict) -> Finding:
    """A checked collapsed head: its kind, the ablation effects against the baseline, the value side labelled."""
    value_side = heads.get((row.layer, row.head))
    norms = ""
    if value_side is not None and value_side.contribution_ratio is not None:
        norms = f" Value norms (not evidence of effect): contribution ratio {value_side.contribution_ratio:.2f}."
    return Finding(
        kind=row.kind,
        severity=KINDS[row.kind].severity,
        layer=row.layer,
        head=row.head,
        position=value_side.dominant_position if value_side is not None else None,
        token=value_side.dominant_token if value_side is not None else None,
        value=row.mean_ablation.effect,
        detail=check_sentence(row, check) + "." + norms,
    )


def verdict_finding(row: HeadCollapseRow) -> Finding:
    """A concentrated head: its value-side verdict, the key it concentrates on and its mean max weight."""
    return Finding(
        kind=row.verdict,
        severity=SEVERITY[row.verdict],
        layer=row.layer,
        head=row.head,
        position=row.dominant_position,
        token=row.dominant_token,
        value=row.mean_max_weight,
        detail=describe(row),
    )


def entropy_bound_finding(numbers: CollapseNumbers) -> Finding:
    """The Zhai et al. bound on the sharpest and the flattest head: collapse needs a large score spread."""
    sharpest = numbers.rows[0]
    flattest = min(numbers.rows, key=lambda r: r.mean_centred_score_norm)
    return Finding(
        kind="entropy_bound",
        severity="high" if numbers.bound_violations else "low",
        layer=sharpest.layer,
        head=sharpest.head,
        value=sharpest.mean_centred_score_norm,
        detail=(
            f"Collapse needs large score spread: {head_name(sharpest.layer, sharpest.head)}'s rows have centred "
            f"score norm r = {sharpest.mean_centred_score_norm:.2f} (Zhai bound ≥ {sharpest.mean_entropy_bound:.3f} "
            f"nats), while {head_name(flattest.layer, flattest.head)} with r = {flattest.mean_centred_score_norm:.2f} "
            f"must keep ≥ {flattest.mean_entropy_bound:.3f} nats (it has {flattest.mean_entropy:.3f}); "
            f"{numbers.bound_violations} of {numbers.rows_counted} rows violate the bound"
        ),
    )


def baseline_finding(check: CollapseCheck) -> Finding:
    """How the check was run: methods, the baseline, the heads together, the rule and the cost."""
    unit = _unit(check)
    together = (" " + together_sentence(check)) if check.together is not None else ""
    resample = _baseline_text(check.baseline, "resample", unit)
    notes = (" " + "; ".join(check.notes) + ".") if check.notes else ""
    return Finding(
        kind="ablation_check",
        severity="low",
        value=check.forward_equivalents,
        detail=(
            f"Checked {check.checked} of {check.collapsed} collapsed heads by mean-ablation and resample-ablation "
            f"(source: {check.resample_source}; resample baseline {resample}); {check.rule}.{together} Cost "
            f"{check.forward_equivalents:g} forward passes.{notes}"
        ),
    )


def ordered_checks(check: CollapseCheck) -> list[CollapseCheckRow]:
    """Checked heads, those whose removal moved the loss first (harmful, load-bearing, mixed), by |effect|."""
    rank = list(KINDS)
    return sorted(check.heads, key=lambda r: (rank.index(r.kind), -abs(r.mean_ablation.effect)))


def findings(numbers: CollapseNumbers, *, top_k: int) -> list[Finding]:
    """Every checked head first (harmful and load-bearing first, up to :data:`MAX_NAMED`), then the other ``top_k``
    most collapsed concentrated heads (value side), then how the check ran and the entropy bound."""
    found: list[Finding] = []
    named: set[tuple[int, int]] = set()
    if numbers.check is not None:
        by_head = {(r.layer, r.head): r for r in numbers.rows}
        for row in ordered_checks(numbers.check)[:MAX_NAMED]:
            found.append(check_finding(row, numbers.check, by_head))
            named.add((row.layer, row.head))
    rest = [r for r in numbers.concentrated[:top_k] if (r.layer, r.head) not in named]
    found += [verdict_finding(row) for row in rest]
    if numbers.check is not None:
        found.append(baseline_finding(numbers.check))
    if numbers.rows:
        found.append(entropy_bound_finding(numbers))
    return found


# --- summary ----------------------------------------------------------------------------------------------


def _target(row: HeadCollapseRow) -> str:
    if row.verdict == "positional":
        return _positional_key(row)
    if row.verdict == "query_dependent":
        return "a different key per query"
    return f"{row.dominant_position}:{row.dominant_token!r}"


def _parked_tail(rows: list[HeadCollapseRow]) -> str:
    """Heads below the collapse thresholds that still park half their weight on a sink that writes little."""
    parked = [
        r
        for r in rows
        if r.verdict == "not_collapsed"
        and r.concentration == "sink"
        and r.dominant_share >= 0.5
        and r.contribution_ratio is not None
        and r.contribution_ratio < NO_OP_CONTRIBUTION
    ]
    if not parked:
        return ""
    return f" {len(parked)} more heads park ≥ 50% of their weight on a first/special token that writes little (no-ops)."


def _named(row: HeadCollapseRow) -> str:
    ratio = "" if row.contribution_ratio is None else f", contribution ratio {row.contribution_ratio:.2f}"
    return (
        f"{_where(row)} → {_target(row)} (mean max {row.mean_max_weight:.3f}, {row.verdict.replace('_', ' ')}{ratio})"
    )


def _value_sentence(numbers: CollapseNumbers) -> str:
    """The value-side counts, labelled as what they are."""
    counts = numbers.verdict_counts
    writing, sinks = counts.get("writing_collapse", 0), counts.get("no_op_sink", 0)
    positional = counts.get("positional", 0)
    return (
        f"Value side (norms, not effects): {writing} collapse onto a key that writes substantially, {sinks} onto "
        f"one that writes < {NO_OP_CONTRIBUTION} × an ordinary key's ‖v W_O‖ (no-op sinks); {positional} are "
        "positional."
    )


def _check_summary(check: CollapseCheck) -> str:
    """What removing the collapsed heads did: the heads that moved the loss first, then the others by kind."""
    ordered = ordered_checks(check)
    moved = [r for r in ordered if KINDS[r.kind].moved]
    quiet = [r for r in ordered if r not in moved]
    what = "next-token loss" if check.measure == "next_token_loss" else "the output embedding"
    of = "" if check.checked == check.collapsed else f" (of {check.collapsed})"
    unit = _unit(check)
    head = (
        f"Removing each of {check.checked} collapsed heads{of} ({what}; {_baseline_text(check.baseline, 'mean', unit)}"
        f" for mean-ablation): "
    )
    shown = (moved[:3] + quiet)[:3]
    rest = [r for r in ordered if r not in shown]
    tail = ""
    if rest:
        kinds = Counter(KINDS[r.kind].plural for r in rest)  # in the order first seen
        tail = "; " + ", ".join(f"{n} more {k}" for k, n in kinds.items())
    harmful = sum(1 for r in check.heads if r.kind == "harmful")
    verdict = (
        " None is harmful (no removal lowers the loss beyond chance)."
        if not harmful and check.measure == "next_token_loss"
        else ""
    )
    together = (" " + together_sentence(check)) if check.together is not None else ""
    return head + "; ".join(check_sentence(r, check, baseline=False) for r in shown) + tail + "." + together + verdict


def summary(numbers: CollapseNumbers) -> str:
    """How many heads are concentrated, what removing the collapsed ones did (when checked), the value side and
    the most collapsed heads."""
    rows, concentrated = numbers.rows, numbers.concentrated
    head = f"{len(concentrated)} of {len(rows)} heads on {numbers.num_tokens} tokens are concentrated"
    tail = _parked_tail(rows)
    if not concentrated:
        best = rows[0]
        return (
            f"{head}: none collapses. The sharpest is {head_name(best.layer, best.head)} (mean max weight "
            f"{best.mean_max_weight:.3f}, onto {_target(best)}).{tail}"
        )
    named = "; ".join(_named(r) for r in concentrated[: 2 if numbers.check is not None else 3])
    checked = (
        " " + _check_summary(numbers.check)
        if numbers.check is not None
        else " Not checked by ablation (causal_check off): nothing here says whether a collapse matters."
    )
    return f"{head}.{checked} {_value_sentence(numbers)} Most collapsed: {named}.{tail}"


# --- next calls -------------------------------------------------------------------------------------------


def next_calls(args: DiagnoseCollapseInput, report: CollapseReport) -> list[NextCall]:
    """Remove the harmful heads (or the most collapsed one) to see whether they matter, look at the first one's
    map, and rebuild it to see which ingredient makes it collapse."""
    moved = []
    if report.check is not None:
        moved = [(r.layer, r.head) for r in report.check.heads if KINDS[r.kind].moved]
    concentrated = [(r.layer, r.head) for r in report.heads if r.verdict != "not_collapsed"]
    focus = moved or concentrated or [(r.layer, r.head) for r in report.heads[:1]]
    if not focus:
        return []
    layer, head = focus[0]
    labels = [head_label(la, he) for la, he in (moved[:4] or focus[:1])]
    what = "the heads whose removal moved the loss" if moved else "the most collapsed head"
    where, name = {"layer": layer, "head": head}, head_name(layer, head)
    return [
        text_follow_up(
            args,
            "ablate_heads",
            {"heads": labels},
            f"remove {what} ({', '.join(labels)}) on this text and see KL, loss and top token against random heads",
        ),
        text_follow_up(args, "show_attention", where, f"{name}'s map, query by query"),
        text_follow_up(
            args,
            "reconstruct_attention",
            where,
            f"which step (scale, projections, positions, mask) makes {name} collapse",
        ),
    ]
