"""corpus_summary's work: no forward pass; it reads an allowed run folder's summary, or scans an allowed data file.

Only :meth:`Inspector.data_file` turns the agent's ``data`` into a path, and it returns one of the operator's
``allowed_data`` or refuses. The reading goes through :mod:`agent_tools.runs.store` and
:mod:`agent_tools.runs.items`, which use no tool.
"""

from __future__ import annotations

from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Any

from agent_tools.inspector import Inspector
from agent_tools.runs.items import read_items
from agent_tools.runs.store import is_run_folder, read_run
from agent_tools.tools.corpus_summary import narrative
from agent_tools.tools.corpus_summary.models import (
    CorpusSummaryInput,
    CorpusSummaryReport,
    DataFacts,
    HeadEntry,
    SegmentEntry,
)

SCANNED = 100_000  # records of a raw data file read at most
PROBLEMS_SHOWN = 5


def corpus_summary(inspector: Inspector, args: CorpusSummaryInput) -> CorpusSummaryReport:
    """List the allowed data, or summarise the allowed run folder / data file the agent names."""
    allowed = [path.name for path in inspector.allowed_data]
    base: dict[str, Any] = {"model": inspector.policy.default, "allowed": allowed, "data": args.data}
    if args.data is None:
        report = CorpusSummaryReport(kind="list", summary="", **base)
    else:
        path = inspector.data_file(args.data)
        report = _run_report(path, base, args.top_k) if is_run_folder(path) else _data_report(path, base)
    return report.model_copy(update={"summary": narrative.summary(report), "findings": narrative.findings(report)})


def _interval(stats: dict[str, Any]) -> list[float | None]:
    return [stats.get("ci_low"), stats.get("ci_high")]


def _segment(row: dict[str, Any], key: str) -> SegmentEntry:
    share, rate = row["metrics"].get("share", {}), row["read_most_rate"]
    return SegmentEntry(
        segment=str(row[key]),
        items=int(row["items"]),
        share=share.get("mean"),
        share_ci=_interval(share),
        read_most_rate=rate.get("mean"),
        read_most_ci=_interval(rate),
    )


def _run_report(path: Path, base: dict[str, Any], top_k: int) -> CorpusSummaryReport:
    """A corpus run folder: its manifest, and the summary's stable/variable heads or segments."""
    manifest, summary = read_run(path)
    fields: dict[str, Any] = {"task": manifest.get("task"), "complete": bool(manifest.get("complete"))}
    base = base | {"model": str(manifest.get("model") or base["model"])}
    if summary is None:
        return CorpusSummaryReport(kind="run", summary="", **base, **fields)
    fields |= {key: summary.get(key) for key in ("items", "analysed", "errors")}
    if summary.get("task") == "trace":
        fields["segments"] = [_segment(row, "segment") for row in summary.get("segments", [])[:top_k]]
        fields["kinds"] = [_segment(row, "kind") for row in summary.get("kinds", [])[:top_k]]
    else:
        stable, variable = summary.get("stable_heads", []), summary.get("variable_heads", [])
        fields |= {"stable_count": len(stable), "variable_count": len(variable)}
        fields["stable_heads"] = [HeadEntry.model_validate(h) for h in stable[:top_k]]
        fields["variable_heads"] = [HeadEntry.model_validate(h) for h in variable[:top_k]]
    return CorpusSummaryReport(kind="run", summary="", **base, **fields)


def _data_report(path: Path, base: dict[str, Any]) -> CorpusSummaryReport:
    """A raw data file: how many items, text or chat, which roles, how long, and which cannot be read."""
    items = unreadable = texts = chats = 0
    role_counts: Counter[str] = Counter()
    sizes: list[int] = []
    problems: list[str] = []
    for item in islice(read_items(path), SCANNED):
        items += 1
        if item.problem is not None:
            unreadable += 1
            if len(problems) < PROBLEMS_SHOWN:
                problems.append(f"item {item.index}: {item.problem}")
            continue
        if item.messages is not None:
            chats += 1
            role_counts.update(str(m.get("role")) for m in item.messages)
        else:
            texts += 1
        sizes.append(item.size)
    facts = DataFacts(
        items=items,
        text_items=texts,
        message_items=chats,
        unreadable=unreadable,
        roles=dict(role_counts.most_common()),
        mean_characters=round(sum(sizes) / len(sizes), 1) if sizes else 0.0,
        max_characters=max(sizes, default=0),
        problems=problems,
    )
    return CorpusSummaryReport(kind="data", summary="", items=items, data_facts=facts, **base)
