"""corpus_summary: what a corpus says about the heads (or the segments), over data the operator allowed.

Reads only paths in the session's ``allowed_data`` (``--allow-data PATH``): a corpus run folder written by
``attention-explainer corpus`` (its summary: stable and variable heads, segment read-most rates with bootstrap
intervals) or a raw data file (what it holds). No forward pass: a corpus run is an operator's job.

``models`` holds the arguments and report, ``plan`` the reading, ``narrative`` the summary and findings.
"""

from __future__ import annotations

from agent_tools.tools.corpus_summary.models import (
    DESCRIPTION,
    CorpusSummaryInput,
    CorpusSummaryReport,
)
from agent_tools.tools.corpus_summary.narrative import next_calls
from agent_tools.tools.corpus_summary.plan import corpus_summary
from agent_tools.tools.registry import ToolSpec, Top

__all__ = [
    "SPEC",
    "CorpusSummaryInput",
    "CorpusSummaryReport",
    "corpus_summary",
]

SPEC = ToolSpec(
    name="corpus_summary",
    description=DESCRIPTION,
    input_model=CorpusSummaryInput,
    output_model=CorpusSummaryReport,
    run=corpus_summary,
    example={},  # lists the allowed data: valid in every session
    summary_lists=(
        Top("segments", 12, by="share"),
        Top("kinds", 12, by="share"),
    ),
    next_calls=next_calls,
    advanced=("top_k",),
)
