"""Tracing a prompt: which of its segments (system, user turns, named spans, template, sink) the answer reads.

A service shared by the prompt tools (``trace_prompt_attention`` reports one trace, ``compare_prompts`` two),
so that neither tool imports the other:

* :mod:`.models` — the report models (:class:`PromptTrace`), :data:`Target`, and the argument descriptions
  both tools use;
* :mod:`.measure` — the traced pass through the inspector (:func:`trace_pass`) and the numbers it yields
  (:func:`measure`);
* :mod:`.narrative` — the findings and summary, written from those numbers;
* :mod:`.report` — :func:`trace`: pass, numbers, rows and narrative assembled into a :class:`PromptTrace`.

Prompts are split into segments by :mod:`agent_tools.prompt_segments`.
"""

from __future__ import annotations

from agent_tools.prompt_trace.measure import TracedPrompt, TraceNumbers, check_traceable, measure, trace_pass
from agent_tools.prompt_trace.models import (
    DEFAULT_SINK_THRESHOLD,
    PROMPT_DESCRIPTION,
    SINK_DESCRIPTION,
    TARGET_DESCRIPTION,
    TARGETS,
    GeneratedToken,
    PromptTrace,
    SegmentShare,
    Target,
    TokenProbability,
    max_new_tokens_in_range,
)
from agent_tools.prompt_trace.report import TraceRun, build_report, next_token_table, trace

__all__ = [
    "DEFAULT_SINK_THRESHOLD",
    "PROMPT_DESCRIPTION",
    "SINK_DESCRIPTION",
    "TARGETS",
    "TARGET_DESCRIPTION",
    "GeneratedToken",
    "PromptTrace",
    "SegmentShare",
    "Target",
    "TokenProbability",
    "TraceNumbers",
    "TraceRun",
    "TracedPrompt",
    "build_report",
    "check_traceable",
    "max_new_tokens_in_range",
    "measure",
    "next_token_table",
    "trace",
    "trace_pass",
]
