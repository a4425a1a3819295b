"""diagnose_collapse's words: the summary and findings, written from numbers the plan has already computed.

Pure functions of :class:`CollapseNumbers` and the rounded report rows, so the text can be read (and changed)
without running a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agent_tools.analysis.collapse import NO_OP_CONTRIBUTION, Verdict
from agent_tools.schemas import Finding, NextCall, Severity, follow_up
from agent_tools.tools.diagnose_collapse.models import CollapseReport, DiagnoseCollapseInput, HeadCollapseRow


@dataclass(frozen=True)
class CollapseNumbers:
    """What the pass measured, as the report states it: every examined head's row, most collapsed first."""

    num_tokens: int
    rows: list[HeadCollapseRow]
    verdict_counts: dict[str, int]
    bound_violations: int  # rows, over every head, whose entropy fell below the Zhai et al. bound
    rows_counted: int  # rows, over every head, that the bound was checked on

    @property
    def concentrated(self) -> list[HeadCollapseRow]:
        """The heads with a verdict other than ``not_collapsed``, most collapsed first."""
        return [r for r in self.rows if r.verdict != "not_collapsed"]


# --- one sentence per verdict -----------------------------------------------------------------------------


def _where(row: HeadCollapseRow) -> str:
    return f"L{row.layer}H{row.head}"


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


def _harmful_collapse(row: HeadCollapseRow) -> str:
    return (
        f"{_where(row)} collapses onto {_onto(row)} whatever the query ({_weight(row)}) and that key's value is "
        f"substantial{_value_side(row)}: the head writes about the same vector at every position"
    )


def _positional(row: HeadCollapseRow) -> str:
    which = "itself" if row.concentration == "self" else "the previous token"
    frac = row.self_fraction if row.concentration == "self" else row.previous_fraction
    return f"{_where(row)} attends to {which} on {frac:.0%} of rows ({_weight(row)}): a positional head, not a failure"


def _query_dependent(row: HeadCollapseRow) -> str:
    return f"{_where(row)} is sharp ({_weight(row)}) but its chosen key changes with the query"


def _not_collapsed(row: HeadCollapseRow) -> str:
    return (
        f"{_where(row)} is not collapsed: mean entropy {row.mean_entropy:.3f} nats ({row.mean_normalised_entropy:.0%} "
        f"of uniform), mean max weight {row.mean_max_weight:.3f}"
    )


_DESCRIBE: dict[Verdict, Callable[[HeadCollapseRow], str]] = {
    "no_op_sink": _no_op_sink,
    "harmful_collapse": _harmful_collapse,
    "positional": _positional,
    "query_dependent": _query_dependent,
    "not_collapsed": _not_collapsed,
}


def describe(row: HeadCollapseRow) -> str:
    """One sentence on one head, by its verdict."""
    return _DESCRIBE[row.verdict](row)


# --- findings ---------------------------------------------------------------------------------------------


# How much each verdict matters to an agent: a harmful collapse is what to act on, a no-op sink is context.
SEVERITY: dict[Verdict, Severity] = {
    "harmful_collapse": "high",
    "positional": "medium",
    "query_dependent": "medium",
    "no_op_sink": "low",
    "not_collapsed": "low",
}
MAX_HARMFUL_NAMED = 12  # harmful heads named in the summary and findings (all of them, up to this many)


def verdict_finding(row: HeadCollapseRow) -> Finding:
    """A concentrated head: its verdict, the key it concentrates on and its mean max weight."""
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
            f"Collapse needs large score spread: L{sharpest.layer}H{sharpest.head}'s rows have centred score "
            f"norm r = {sharpest.mean_centred_score_norm:.2f} (Zhai bound ≥ {sharpest.mean_entropy_bound:.3f} "
            f"nats), while L{flattest.layer}H{flattest.head} with r = {flattest.mean_centred_score_norm:.2f} "
            f"must keep ≥ {flattest.mean_entropy_bound:.3f} nats (it has {flattest.mean_entropy:.3f}); "
            f"{numbers.bound_violations} of {numbers.rows_counted} rows violate the bound"
        ),
    )


def harmful(numbers: CollapseNumbers) -> list[HeadCollapseRow]:
    """Every harmful collapse, most collapsed first: what the summary counts, named wherever it is listed."""
    return [r for r in numbers.rows if r.verdict == "harmful_collapse"]


def findings(numbers: CollapseNumbers, *, top_k: int) -> list[Finding]:
    """Every harmful collapse first (up to :data:`MAX_HARMFUL_NAMED`, whatever ``top_k``), then the other
    ``top_k`` most collapsed concentrated heads, then the entropy bound (when any head was examined)."""
    first = harmful(numbers)[:MAX_HARMFUL_NAMED]
    named = {(r.layer, r.head) for r in first}
    rest = [r for r in numbers.concentrated[:top_k] if (r.layer, r.head) not in named]
    found = [verdict_finding(row) for row in [*first, *rest]]
    if numbers.rows:
        found.append(entropy_bound_finding(numbers))
    return found


# --- summary ----------------------------------------------------------------------------------------------


def _target(row: HeadCollapseRow) -> str:
    if row.verdict == "positional":
        return "itself" if row.concentration == "self" else "the previous token"
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
        f"L{row.layer}H{row.head} → {_target(row)} (mean max {row.mean_max_weight:.3f}, "
        f"{row.verdict.replace('_', ' ')}{ratio})"
    )


def _verdict_sentence(numbers: CollapseNumbers) -> str:
    counts = numbers.verdict_counts
    sinks, positional = counts.get("no_op_sink", 0), counts.get("positional", 0)
    bad = harmful(numbers)
    shown = ", ".join(_where(r) for r in bad[:MAX_HARMFUL_NAMED])
    more = f" and {len(bad) - MAX_HARMFUL_NAMED} more" if len(bad) > MAX_HARMFUL_NAMED else ""
    harm = (
        f"{len(bad)} collapse harmfully onto one token whatever the query ({shown}{more})"
        if bad
        else ("none collapses harmfully")
    )
    return (
        f"{harm}; {sinks} are no-op sinks (the dominant key writes < {NO_OP_CONTRIBUTION} × an ordinary key's "
        f"‖v W_O‖), {positional} are positional."
    )


def summary(numbers: CollapseNumbers) -> str:
    """How many heads are concentrated, the three most collapsed (or the sharpest), and the verdict counts."""
    rows, concentrated = numbers.rows, numbers.concentrated
    head = f"{len(concentrated)} of {len(rows)} heads on {numbers.num_tokens} tokens are concentrated"
    tail = _parked_tail(rows)
    if not concentrated:
        best = rows[0]
        return (
            f"{head}: none collapses. The sharpest is L{best.layer}H{best.head} (mean max weight "
            f"{best.mean_max_weight:.3f}, onto {_target(best)}).{tail}"
        )
    named = "; ".join(_named(r) for r in concentrated[:3])
    verdicts = _verdict_sentence(numbers)
    return f"{head}. {verdicts[0].upper()}{verdicts[1:]} Most collapsed: {named}.{tail}"


# --- next calls -------------------------------------------------------------------------------------------


def next_calls(args: DiagnoseCollapseInput, report: CollapseReport) -> list[NextCall]:
    """Remove the harmful heads (or the most collapsed one) to see whether they matter, look at the first one's
    map, and rebuild it to see which ingredient makes it collapse."""
    bad = [(f.layer, f.head) for f in report.findings if f.kind == "harmful_collapse" and f.layer is not None]
    concentrated = [(r.layer, r.head) for r in report.heads if r.verdict != "not_collapsed"]
    focus = bad or concentrated or [(r.layer, r.head) for r in report.heads[:1]]
    if not focus:
        return []
    layer, head = focus[0]
    labels = [f"{la}.{he}" for la, he in (bad[:4] or focus[:1])]
    what = "the harmful collapse" if bad else "the most collapsed head"
    return [
        follow_up(
            "ablate_heads",
            {"text": args.text, "heads": labels},
            f"remove {what} ({', '.join(labels)}): a large KL confirms it matters, a tiny one says it is a no-op",
            model=args.model,
        ),
        follow_up(
            "show_attention",
            {"text": args.text, "layer": layer, "head": head},
            f"L{layer}H{head}'s map, query by query",
            model=args.model,
        ),
        follow_up(
            "reconstruct_attention",
            {"text": args.text, "layer": layer, "head": head},
            f"which step (scale, projections, positions, mask) makes L{layer}H{head} collapse",
            model=args.model,
        ),
    ]
