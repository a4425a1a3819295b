"""Tracing a prompt: which of its segments (system, user turns, named spans, template, sink) the answer reads.

A service shared by the prompt tools (``trace_prompt_attention`` reports one trace, ``compare_prompts`` two),
so that neither tool imports the other:

* :mod:`.models` — the report models (:class:`PromptTrace`), :data:`Target`, and the argument descriptions
  both tools use;
* :mod:`.measure` — the traced pass through the inspector (:func:`trace_pass`) and the numbers it yields
  (:func:`measure`);
* :mod:`.narrative` — the findings and summary, written from those numbers;
* :mod:`.evidence` — the checks beside attention (causal effects, gradient attribution) and how the measures
  rank the segments; :mod:`.claims` — their words; :mod:`.next_calls` — the calls that would test the lead;
* :mod:`.report` — :func:`trace`: pass, numbers, checks, rows and narrative assembled into a :class:`PromptTrace`.

Prompts are split into segments by :mod:`agent_tools.prompt_segments`.
"""

from __future__ import annotations

from agent_tools.prompt_trace.evidence import EvidenceRequest
from agent_tools.prompt_trace.evidence import prepare as prepare_evidence
from agent_tools.prompt_trace.measure import TracedPrompt, TraceNumbers, check_traceable, measure, trace_pass
from agent_tools.prompt_trace.models import (
    ANSWER_DESCRIPTION,
    CHECKS,
    CHECKS_DESCRIPTION,
    DEFAULT_SINK_THRESHOLD,
    FILLER_DESCRIPTION,
    IG_STEPS_DESCRIPTION,
    MAX_IG_STEPS,
    NEUTRAL_DESCRIPTION,
    PROMPT_DESCRIPTION,
    SINK_DESCRIPTION,
    TARGET_DESCRIPTION,
    TARGETS,
    CausalEffect,
    Check,
    GeneratedToken,
    GradientAttribution,
    NextCall,
    PromptTrace,
    SegmentShare,
    Target,
    TokenProbability,
    max_new_tokens_in_range,
)
from agent_tools.prompt_trace.report import TraceRun, build_report, next_token_table, trace

__all__ = [
    "ANSWER_DESCRIPTION",
    "CHECKS",
    "CHECKS_DESCRIPTION",
    "DEFAULT_SINK_THRESHOLD",
    "FILLER_DESCRIPTION",
    "IG_STEPS_DESCRIPTION",
    "MAX_IG_STEPS",
    "NEUTRAL_DESCRIPTION",
    "PROMPT_DESCRIPTION",
    "SINK_DESCRIPTION",
    "TARGETS",
    "TARGET_DESCRIPTION",
    "CausalEffect",
    "Check",
    "EvidenceRequest",
    "GeneratedToken",
    "GradientAttribution",
    "NextCall",
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
    "prepare_evidence",
    "trace",
    "trace_pass",
]
