"""compare_prompts' arguments and report models."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from agent_tools.inspector import MAX_NEW_TOKENS
from agent_tools.prompt_segments import SegmentSpec
from agent_tools.prompt_trace import (
    DEFAULT_SINK_THRESHOLD,
    PROMPT_DESCRIPTION,
    SINK_DESCRIPTION,
    TARGET_DESCRIPTION,
    PromptTrace,
    Target,
    TokenProbability,
    max_new_tokens_in_range,
)
from agent_tools.schemas import ChatMessage, ModelInput, Report

DESCRIPTION = (
    "Compare two prompt variants (texts or chat message lists): each segment's share of the answer's attention "
    "side by side (matched by role/turn and by the names you give), the largest shifts, and how the output "
    "changed — KL divergence and top tokens of the next-token distribution, or the generated texts."
)


class ComparePromptsInput(ModelInput):
    prompt_a: str | list[ChatMessage] = Field(description="the first variant: " + PROMPT_DESCRIPTION)
    prompt_b: str | list[ChatMessage] = Field(description="the second variant, same form")
    segments_a: list[SegmentSpec] | None = Field(default=None, description="named segments of prompt_a")
    segments_b: list[SegmentSpec] | None = Field(
        default=None, description="named segments of prompt_b (give the same names to compare them)"
    )
    target: Target = Field(default="last", description=TARGET_DESCRIPTION)
    max_new_tokens: int = Field(
        default=16,
        ge=1,
        le=MAX_NEW_TOKENS,
        description=f"tokens to generate with target='generate' (1..{MAX_NEW_TOKENS})",
    )
    sink_threshold: float = Field(default=DEFAULT_SINK_THRESHOLD, gt=0, le=1, description=SINK_DESCRIPTION)

    _max_new_tokens_range = field_validator("max_new_tokens", mode="before")(max_new_tokens_in_range)


class SegmentComparison(BaseModel):
    name: str = Field(description="segment name, matched across the variants (role and turn, or the name given)")
    kind: str
    share_a: float | None = Field(description="share in variant A (mean over layers and heads); None: absent")
    share_b: float | None
    change: float = Field(description="share_b - share_a (an absent segment counts as 0)")
    share_without_sink_a: float | None
    share_without_sink_b: float | None
    last_layer_a: float | None
    last_layer_b: float | None
    rollout_without_sink_a: float | None
    rollout_without_sink_b: float | None
    token_count_a: int
    token_count_b: int


class PromptComparison(Report):
    target: Target
    segments: list[SegmentComparison] = Field(description="every segment of either variant, largest |change| first")
    read_most_a: str
    read_most_b: str
    next_token_kl: float | None = Field(
        description="KL(P_a ‖ P_b) in nats between the next-token distributions at the last prompt positions"
    )
    next_tokens_a: list[TokenProbability] | None
    next_tokens_b: list[TokenProbability] | None
    same_top_token: bool | None
    generated_text_a: str | None = None
    generated_text_b: str | None = None
    first_difference: int | None = Field(
        default=None, description="first generated step where the variants chose different tokens (None: same)"
    )
    trace_a: PromptTrace
    trace_b: PromptTrace
