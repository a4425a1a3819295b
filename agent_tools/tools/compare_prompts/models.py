"""compare_prompts' arguments and report models."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from agent_tools.prompt_segments import SegmentSpec
from agent_tools.schemas import ChatMessage, ModelInput, NextCall, Report, Rounded
from agent_tools.stack_input import TRACE_ATTENTION_DESCRIPTION, AttentionStack, StackReport
from agent_tools.traced_prompt.models import (
    ANSWER_STOP_DESCRIPTION,
    DEFAULT_ANSWER_STOP,
    DEFAULT_SINK_THRESHOLD,
    FILLER_DESCRIPTION,
    IG_STEPS_DESCRIPTION,
    MAX_IG_STEPS,
    NEUTRAL_DESCRIPTION,
    SINK_DESCRIPTION,
    AnswerStop,
    Check,
    MaxNewTokens,
    MeasuredTrace,
    Target,
    TokenProbability,
    answer_stop_form,
)

DESCRIPTION = (
    "Two prompt variants side by side: each segment's attention share and causal effect, the largest shifts, the "
    "output change. Use to see what a prompt edit did."
)


class ComparePromptsInput(ModelInput):
    prompt_a: str | list[ChatMessage]
    prompt_b: str | list[ChatMessage]
    segments_a: list[SegmentSpec] | None = Field(default=None, description="named segments of prompt_a")
    segments_b: list[SegmentSpec] | None = Field(default=None, description="the same names compare")
    target: Target = "last"
    max_new_tokens: MaxNewTokens = 16
    answer_stop: AnswerStop = Field(default=DEFAULT_ANSWER_STOP, description=ANSWER_STOP_DESCRIPTION)
    sink_threshold: float = Field(default=DEFAULT_SINK_THRESHOLD, gt=0, le=1, description=SINK_DESCRIPTION)
    checks: list[Check] | None = None
    answer: str | None = Field(default=None, min_length=1)
    neutral_token: str | None = Field(default=None, min_length=1, description=NEUTRAL_DESCRIPTION)
    ig_steps: int = Field(default=32, ge=2, le=MAX_IG_STEPS, description=IG_STEPS_DESCRIPTION)
    exclude_filler: bool = Field(default=True, description=FILLER_DESCRIPTION)
    attention: AttentionStack | None = Field(default=None, description=TRACE_ATTENTION_DESCRIPTION)

    _answer_stop_form = model_validator(mode="before")(answer_stop_form)


class SegmentComparison(BaseModel):
    name: str = Field(description="segment name, matched across the variants (role and turn, or the name given)")
    kind: str
    share_a: float | None = Field(description="share in variant A (mean over layers and heads); None: absent")
    share_b: float | None
    change: Rounded = Field(description="share_b - share_a (an absent segment counts as 0)")
    share_without_sink_a: float | None
    share_without_sink_b: float | None
    last_layer_a: float | None
    last_layer_b: float | None
    rollout_without_sink_a: float | None
    rollout_without_sink_b: float | None
    token_count_a: int
    token_count_b: int
    removed_a: float | None = Field(
        default=None,
        description="Δ log p of A's deciding answer token when the segment is removed (negative: A's answer depends "
        "on it; positive: it works against it)",
    )
    removed_b: float | None = None
    value_share_a: float | None = Field(default=None, description="value-weighted share ‖α·v·W_O‖ in variant A")
    value_share_b: float | None = None


class PromptComparison(Report, StackReport):
    target: Target
    segments: list[SegmentComparison] = Field(description="every segment of either variant, largest |change| first")
    read_most_a: str
    read_most_b: str
    next_token_kl: Rounded | None = Field(
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
    depends_on_most_a: str | None = Field(
        default=None, description="the named segment whose removal lowers A's deciding token's log p most"
    )
    depends_on_most_b: str | None = None
    inserted_a: list[str] = Field(default_factory=list, description="text A's chat template inserted (segments)")
    inserted_b: list[str] = Field(default_factory=list, description="text B's chat template inserted (segments)")
    trace_a: MeasuredTrace = Field(
        description="variant A's traced numbers: trace_prompt_attention's, without its words"
    )
    trace_b: MeasuredTrace
    next_calls: list[NextCall] = Field(default_factory=list, description="calls that would confirm or refute the lead")
