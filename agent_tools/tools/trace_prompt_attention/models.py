"""trace_prompt_attention's arguments and report models (the report is the shared prompt trace's)."""

from __future__ import annotations

from pydantic import Field, field_validator

from agent_tools.inspector import MAX_NEW_TOKENS
from agent_tools.prompt_segments import SegmentSpec
from agent_tools.prompt_trace import (
    ANSWER_DESCRIPTION,
    CHECKS_DESCRIPTION,
    DEFAULT_SINK_THRESHOLD,
    FILLER_DESCRIPTION,
    IG_STEPS_DESCRIPTION,
    MAX_IG_STEPS,
    NEUTRAL_DESCRIPTION,
    PROMPT_DESCRIPTION,
    SINK_DESCRIPTION,
    TARGET_DESCRIPTION,
    Check,
    GeneratedToken,
    PromptTrace,
    SegmentShare,
    Target,
    TokenProbability,
    max_new_tokens_in_range,
)
from agent_tools.schemas import ChatMessage, ModelInput

__all__ = ["GeneratedToken", "PromptTrace", "SegmentShare", "TokenProbability", "TracePromptInput"]

DESCRIPTION = (
    "Trace which parts of a prompt the answer reads: split a text or chat (system, user/assistant turns, "
    "template tokens, spans you name) into segments and report each segment's share of the attention of the "
    "answer position — or of every token the model generates — averaged over layers and heads, in the last "
    "layer and by rollout, with attention-sink tokens kept apart, the top tokens read in each segment, and "
    "which segment was read most and by how much. Beside what the answer reads it checks what it depends on: per "
    "segment the change in the answer's log-probability when the segment is removed or replaced by neutral tokens, "
    "value-weighted shares ‖α·v·W_O‖ with filler/secondary sinks set apart, optionally integrated gradients, and "
    "how far the measures agree."
)
SEGMENTS_DESCRIPTION = (
    "extra segments to name, each a substring (text) or a character span (start, end), optionally inside one "
    "message (message index); a named span takes its tokens out of the message around it"
)


class TracePromptInput(ModelInput):
    prompt: str | list[ChatMessage] = Field(description=PROMPT_DESCRIPTION)
    segments: list[SegmentSpec] | None = Field(default=None, description=SEGMENTS_DESCRIPTION)
    target: Target = Field(default="last", description=TARGET_DESCRIPTION)
    max_new_tokens: int = Field(
        default=16,
        ge=1,
        le=MAX_NEW_TOKENS,
        description=f"tokens to generate with target='generate' (1..{MAX_NEW_TOKENS})",
    )
    top_k: int = Field(default=3, ge=1, le=10, description="most-read tokens listed per segment")
    sink_threshold: float = Field(default=DEFAULT_SINK_THRESHOLD, gt=0, le=1, description=SINK_DESCRIPTION)
    checks: list[Check] | None = Field(default=None, description=CHECKS_DESCRIPTION)
    answer: str | None = Field(default=None, min_length=1, description=ANSWER_DESCRIPTION)
    neutral_token: str | None = Field(default=None, min_length=1, description=NEUTRAL_DESCRIPTION)
    ig_steps: int = Field(default=32, ge=2, le=MAX_IG_STEPS, description=IG_STEPS_DESCRIPTION)
    exclude_filler: bool = Field(default=True, description=FILLER_DESCRIPTION)

    _max_new_tokens_range = field_validator("max_new_tokens", mode="before")(max_new_tokens_in_range)
