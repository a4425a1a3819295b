"""Tracing a prompt: which of its segments (system, user turns, named spans, template, sink) the answer reads.

A service shared by the prompt tools (``trace_prompt_attention`` reports one trace, ``compare_prompts`` two),
so that neither tool imports the other:

* :mod:`.models` — the report models (:class:`PromptTrace`), :data:`Target`, and the argument descriptions
  both tools use;
* :mod:`.measure` — the traced pass through the inspector (:func:`trace_pass`) and the numbers it yields
  (:func:`measure`);
* :mod:`.narrative` — the findings and summary, written from those numbers;
* :mod:`.answer` — where a generated answer ends (``answer_stop``) and which tokens the checks measure;
* :mod:`.evidence` — the checks beside attention (causal effects, gradient attribution) and how the measures
  rank the segments; :mod:`.claims` — their words; :mod:`.next_calls` — the calls that would test the lead;
* :mod:`.report` — :func:`trace`: pass, numbers, checks, rows and narrative assembled into a :class:`PromptTrace`.

Prompts are split into segments by :mod:`agent_tools.prompt_segments`.
"""

from __future__ import annotations

from agent_tools.prompt_trace.evidence import EvidenceRequest
from agent_tools.prompt_trace.evidence import prepare as prepare_evidence
from agent_tools.prompt_trace.measure import check_traceable
from agent_tools.prompt_trace.models import (
    ANSWER_DESCRIPTION,
    ANSWER_STOP_DESCRIPTION,
    CHECKS_DESCRIPTION,
    DEFAULT_ANSWER_STOP,
    DEFAULT_SINK_THRESHOLD,
    FILLER_DESCRIPTION,
    IG_STEPS_DESCRIPTION,
    MAX_IG_STEPS,
    NEUTRAL_DESCRIPTION,
    SEGMENT_RANK_LABEL,
    SINK_DESCRIPTION,
    TARGET_DESCRIPTION,
    AnswerStop,
    Check,
    GeneratedToken,
    NextCall,
    PromptTrace,
    SegmentShare,
    Target,
    TokenProbability,
    answer_stop_form,
    max_new_tokens_in_range,
    segment_rank,
)
from agent_tools.prompt_trace.report import TraceRun, trace

__all__ = [
    "ANSWER_DESCRIPTION",
    "ANSWER_STOP_DESCRIPTION",
    "CHECKS_DESCRIPTION",
    "DEFAULT_ANSWER_STOP",
    "DEFAULT_SINK_THRESHOLD",
    "FILLER_DESCRIPTION",
    "IG_STEPS_DESCRIPTION",
    "MAX_IG_STEPS",
    "NEUTRAL_DESCRIPTION",
    "SEGMENT_RANK_LABEL",
    "SINK_DESCRIPTION",
    "TARGET_DESCRIPTION",
    "AnswerStop",
    "Check",
    "EvidenceRequest",
    "GeneratedToken",
    "NextCall",
    "PromptTrace",
    "SegmentShare",
    "Target",
    "TokenProbability",
    "TraceRun",
    "answer_stop_form",
    "check_traceable",
    "max_new_tokens_in_range",
    "prepare_evidence",
    "segment_rank",
    "trace",
]
