"""trace_prompt_attention: which parts of my prompt (system, user turns, named spans) does the answer read?

``models`` (arguments; the report is the shared :class:`~agent_tools.traced_prompt.models.PromptTrace`), ``plan``
(the traced pass), ``narrative`` (where the summary and findings are written: the shared prompt trace).
"""

from __future__ import annotations

from agent_tools.prompt_segments import MAX_NAMED_SEGMENTS
from agent_tools.tools.registry import ToolSpec, Top
from agent_tools.tools.trace_prompt_attention.models import DESCRIPTION, PromptTrace, TracePromptInput
from agent_tools.tools.trace_prompt_attention.plan import trace_prompt_attention
from agent_tools.traced_prompt.models import SEGMENT_RANK_LABEL, segment_rank

__all__ = ["SPEC", "PromptTrace", "TracePromptInput", "trace_prompt_attention"]

SPEC = ToolSpec(
    name="trace_prompt_attention",
    description=DESCRIPTION,
    input_model=TracePromptInput,
    output_model=PromptTrace,
    run=trace_prompt_attention,
    example={
        "prompt": [
            {"role": "system", "content": "The secret code is 4721."},
            {"role": "user", "content": "What is the secret code?"},
        ],
        "target": "last",
    },
    summary_lists=(
        Top("segments", MAX_NAMED_SEGMENTS, by=segment_rank, label=SEGMENT_RANK_LABEL),
        Top("segments[].positions", 12, order="first"),
        Top("segments[].token_shares", 2, by="share"),
        Top("filler", 8, by="share"),
        Top("findings", 8, order="first"),
        Top("generated", 6, order="first"),
    ),
    advanced=("top_k", "sink_threshold", "neutral_token", "ig_steps", "exclude_filler"),
)
