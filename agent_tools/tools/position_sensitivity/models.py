"""position_sensitivity's arguments and report."""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent_tools.prompt_segments import SegmentSpec
from agent_tools.schemas import ChatMessage, ModelInput, Report, Rounded

DESCRIPTION = (
    "Moves one named segment through positions: the answer's log p and the segment's attention share at each. Use "
    "to find lost-in-the-middle effects."
)


class PositionSensitivityInput(ModelInput):
    prompt: str | list[ChatMessage]
    segments: list[SegmentSpec] = Field(min_length=2, max_length=16, description="the movable pieces (documents)")
    move: str = Field(description="the segment to move")
    answer: str | None = None
    positions: int = Field(default=5, ge=2, le=16, description="positions tried")


class PositionResult(BaseModel):
    slot: int = Field(description="0 = before every other segment; n = after the last")
    start_token: int = Field(description="token position where the moved segment starts")
    prompt_tokens: int = Field(description="tokens of the prompt at this position (answer not counted)")
    relative_depth: Rounded = Field(description="start_token / prompt length, 0..1")
    answer_logprob: Rounded = Field(description="Σ log p of the answer tokens, nats")
    top_token_is_answer: bool = Field(description="the answer's first token is the top next token")
    attention_share: Rounded = Field(
        description="mean over layers, heads and answer rows of the weight on the segment (token 0, the sink, left out)"
    )


class PositionSensitivityReport(Report):
    moved: str
    answer: str
    positions: list[PositionResult]
    best_slot: int
    worst_slot: int
    spread: Rounded = Field(description="best − worst answer log-probability, nats")
    shape: str = Field(description="u_shaped, flat, or other (see summary)")
