"""corpus_summary's summary and findings: pure functions of the numbers the report already holds."""

from __future__ import annotations

from agent_tools.schemas import Finding, NextCall, follow_up
from agent_tools.tools.corpus_summary.models import CorpusSummaryInput, CorpusSummaryReport, HeadEntry, SegmentEntry


def _allowed(report: CorpusSummaryReport) -> str:
    if not report.allowed:
        return "No data files are allowed in this session (the operator allows them with --allow-data PATH)."
    return f"Allowed data: {', '.join(report.allowed)}; name one as data."


def _head_text(head: HeadEntry) -> str:
    return f"{head.head} {head.role} on {head.share:.0%} of items"


def _segment_text(segment: SegmentEntry) -> str:
    rate = "n/a" if segment.read_most_rate is None else f"{segment.read_most_rate:.0%}"
    low, high = segment.read_most_ci if len(segment.read_most_ci) == 2 else (None, None)
    interval = f" (95% CI {low:.0%}–{high:.0%})" if low is not None and high is not None else ""
    return f"{segment.segment} read most in {rate} of its {segment.items} items{interval}"


def _run_summary(report: CorpusSummaryReport) -> str:
    if report.items is None:
        return f"Corpus {report.task} run {report.data} on {report.model} has no summary yet (still running?)."
    state = "" if report.complete else " (not complete)"
    head = (
        f"Corpus {report.task} run {report.data}{state} on {report.model}: {report.items} items, "
        f"{report.analysed} analysed, {report.errors} errors."
    )
    if report.task == "trace":
        leaders = "; ".join(_segment_text(s) for s in report.kinds[:3])
        return f"{head} By kind: {leaders}." if leaders else head
    stable = ", ".join(_head_text(h) for h in report.stable_heads[:3])
    return (
        f"{head} {report.stable_count} heads keep their role on ≥ 80% of items"
        + (f" (e.g. {stable})" if stable else "")
        + f"; {report.variable_count} vary."
    )


def summary(report: CorpusSummaryReport) -> str:
    """Two or three sentences: what is allowed, or the run's counts and leaders, or the data file's contents."""
    if report.kind == "list":
        return _allowed(report)
    if report.kind == "run":
        return _run_summary(report)
    facts = report.data_facts
    if facts is None:
        return f"Data {report.data} could not be summarised."
    return (
        f"Data {report.data}: {facts.items} items ({facts.text_items} texts, {facts.message_items} chats, "
        f"{facts.unreadable} unreadable), {facts.mean_characters:.0f} characters on average, at most "
        f"{facts.max_characters}. Run attention-explainer corpus TASK on it for head or segment statistics."
    )


def _head_finding(head: HeadEntry, kind: str) -> Finding:
    layer, index = (int(part) for part in head.head.split("."))
    word = "keeps" if kind == "stable_head" else "varies; most often"
    detail = f"Head {head.head} {word} {head.role} on {head.share:.0%} of the items."
    return Finding(kind=kind, layer=layer, head=index, value=head.share, detail=detail)


def findings(report: CorpusSummaryReport) -> list[Finding]:
    """One finding per listed stable and variable head, or per segment kind (trace runs)."""
    if report.kind != "run":
        return []
    if report.task == "trace":
        return [
            Finding(kind="segment_read_most", value=s.read_most_rate, detail=_segment_text(s).capitalize() + ".")
            for s in report.kinds
        ]
    return [_head_finding(h, "stable_head") for h in report.stable_heads] + [
        _head_finding(h, "variable_head") for h in report.variable_heads
    ]


def next_calls(args: CorpusSummaryInput, report: CorpusSummaryReport) -> list[NextCall]:
    """The allowed data, each summarised; for a head run, the roles of the first stable head's layer."""
    if report.kind == "list":
        return [follow_up("corpus_summary", {"data": name}, f"what {name} holds") for name in report.allowed[:3]]
    if report.kind == "run" and report.task == "profile" and report.stable_heads:
        layer = int(report.stable_heads[0].head.split(".")[0])
        return [
            follow_up(
                "profile_heads",
                {"layers": [layer]},
                f"head {report.stable_heads[0].head}'s role on a sample text, with ablation evidence",
            )
        ]
    return []
