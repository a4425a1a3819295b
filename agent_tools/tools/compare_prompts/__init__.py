"""compare_prompts: how attention over the prompt's parts shifts between two variants, and what the output does.

``models`` holds the arguments and report, ``plan`` the pass (both variants through the shared traced-prompt
pass, :mod:`agent_tools.traced_prompt`, then their segments matched by name), ``narrative`` the summary and
findings. The report embeds each variant's numbers (``trace_a``, ``trace_b``), not trace_prompt_attention's words.
"""

from __future__ import annotations

from agent_tools.prompt_segments import MAX_NAMED_SEGMENTS
from agent_tools.tools.compare_prompts.models import (
    DESCRIPTION,
    ComparePromptsInput,
    PromptComparison,
    SegmentComparison,
)
from agent_tools.tools.compare_prompts.plan import compare_prompts
from agent_tools.tools.registry import ToolSpec, Top
from agent_tools.traced_prompt.models import SEGMENT_RANK_LABEL, segment_rank

__all__ = ["SPEC", "ComparePromptsInput", "PromptComparison", "SegmentComparison", "compare_prompts"]


def _compared_rank(row: SegmentComparison) -> float:
    """Segments named in either variant always kept (first), then by |share change|."""
    return (1e6 if row.kind == "named" else 0.0) + abs(row.change)


SPEC = ToolSpec(
    name="compare_prompts",
    description=DESCRIPTION,
    input_model=ComparePromptsInput,
    output_model=PromptComparison,
    run=compare_prompts,
    example={
        "prompt_a": "The secret code is 4721. Question: what is the secret code? Answer:",
        "prompt_b": "Question: what is the secret code? The secret code is 4721. Answer:",
    },
    summary_lists=(
        Top("segments", MAX_NAMED_SEGMENTS, by=_compared_rank, label="segments you named first, then |change|"),
        Top("trace_a.segments", MAX_NAMED_SEGMENTS, by=segment_rank, label=SEGMENT_RANK_LABEL),
        Top("trace_a.segments[].positions", 12, order="first"),
        Top("trace_a.segments[].token_shares", 2, by="share"),
        Top("trace_a.filler", 8, by="share"),
        Top("trace_a.generated", 6, order="first"),
        Top("trace_b.segments", MAX_NAMED_SEGMENTS, by=segment_rank, label=SEGMENT_RANK_LABEL),
        Top("trace_b.segments[].positions", 12, order="first"),
        Top("trace_b.segments[].token_shares", 2, by="share"),
        Top("trace_b.filler", 8, by="share"),
        Top("trace_b.generated", 6, order="first"),
    ),
    advanced=(
        "sink_threshold",
        "neutral_token",
        "ig_steps",
        "exclude_filler",
        "segments_a",
        "segments_b",
        "max_new_tokens",
        "answer_stop",
    ),
)
