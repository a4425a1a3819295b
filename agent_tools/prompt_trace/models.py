"""The prompt trace's report models, targets and the argument descriptions the prompt tools share."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, Field

from agent_tools.inspector import MAX_NEW_TOKENS
from agent_tools.schemas import KeyWeight, Report

Target = Literal["last", "generate"]
TARGETS: tuple[str, ...] = get_args(Target)
DEFAULT_SINK_THRESHOLD = 0.1

PROMPT_DESCRIPTION = (
    "plain text, or a list of chat messages [{role, content}] (roles: system, user, assistant) rendered with the "
    "model's own chat template (with the generation prompt for the assistant's answer)"
)
TARGET_DESCRIPTION = (
    "'last': the attention of the last prompt position (where the answer's first token is chosen); "
    "'generate': the model answers greedily and each generated token's attention is traced"
)
SINK_DESCRIPTION = (
    "a token read by at least 4 later queries that receives, on average over them and all layers and heads, at "
    "least this share of their attention (and 2× what uniform attention would give it) joins position 0 in the "
    "'sink' segment"
)


def max_new_tokens_in_range(value: object) -> object:
    """Field validator (mode 'before'): an out-of-range count gets the same message as the inspector's check."""
    if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens {value} out of range 1..{MAX_NEW_TOKENS}")
    return value


class SegmentShare(BaseModel):
    name: str = Field(description="role and turn (system#1, user#2), a named span, template, sink, generated, text")
    kind: str
    message: int | None = Field(default=None, description="0-based message index the segment lies in")
    token_count: int
    positions: list[int] = Field(description="token positions in the segment (generated: keys written by the model)")
    text: str = Field(description="the segment's text, shortened")
    share: float = Field(
        description="share of attention the target reads here, mean over all layers and heads "
        "(target 'generate': also averaged over the generated tokens)"
    )
    share_without_sink: float | None = Field(description="share once the sink is set aside (renormalised)")
    share_per_token: float = Field(description="share / token_count: how densely the segment is read")
    last_layer_share: float = Field(description="share in the last layer alone (mean over its heads)")
    rollout_share: float | None = Field(
        description="share by attention rollout at the last prompt position (None for generated tokens)"
    )
    rollout_share_without_sink: float | None = Field(
        description="rollout share renormalised without the sink (in a causal model rollout drains into position 0)"
    )
    top_tokens: list[KeyWeight] = Field(description="most-read tokens inside the segment (mean over layers, heads)")


class TokenProbability(BaseModel):
    token: str
    token_id: int
    probability: float


class GeneratedToken(BaseModel):
    step: int = Field(description="0 = first answer token")
    position: int = Field(description="the query position whose attention chose this token")
    token: str
    token_id: int
    read_most: str = Field(description="prompt content segment this token's attention read most")
    read_most_share: float
    shares: dict[str, float] = Field(description="share per segment, mean over layers and heads")
    top_key: KeyWeight = Field(description="the single non-sink token read most (mean over layers and heads)")


class PromptTrace(Report):
    target: Target
    prompt_format: Literal["text", "messages"]
    rendered_prompt: str = Field(description="the text the model read (chat template applied)")
    num_tokens: int
    answer_position: int = Field(description="the last prompt position")
    segments: list[SegmentShare]
    sink_positions: list[int]
    sink_threshold: float
    read_most: str = Field(description="the prompt content segment read most (not sink, template or generated)")
    runner_up: str | None
    margin: float = Field(description="read_most share minus runner_up share (mean over layers and heads)")
    next_tokens: list[TokenProbability] | None = Field(
        default=None, description="the model's top next tokens at the last prompt position"
    )
    generated_text: str | None = None
    generated: list[GeneratedToken] | None = None
    stopped: Literal["eos", "max_new_tokens"] | None = None
    seconds_per_token: float | None = Field(default=None, description="wall time per KV-cache step, with capture")
