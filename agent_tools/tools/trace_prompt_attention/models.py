"""trace_prompt_attention's arguments and report: the traced prompt's numbers (the shared
:class:`~agent_tools.traced_prompt.models.MeasuredTrace`) with the trace's words."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator, model_validator

from agent_tools.prompt_segments import SegmentSpec
from agent_tools.schemas import ChatMessage, Finding, ModelInput, NextCall, Report, Rounded, rounded
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
    answer_stop_form,
)

__all__ = ["PromptTrace", "TracePromptInput", "ViewLead"]

DESCRIPTION = (
    "Which prompt parts (system, turns, template, named spans) the answer reads and depends on (removal, value "
    "share). Use for prompt engineering and RAG."
)
SEGMENTS_DESCRIPTION = "spans to name"


class TracePromptInput(ModelInput):
    prompt: str | list[ChatMessage]
    segments: list[SegmentSpec] | None = Field(default=None, description=SEGMENTS_DESCRIPTION)
    target: Target = "last"
    max_new_tokens: MaxNewTokens = 16
    answer_stop: AnswerStop = Field(default=DEFAULT_ANSWER_STOP, description=ANSWER_STOP_DESCRIPTION)
    top_k: int = Field(default=3, ge=1, le=10, description="most-read tokens listed per segment")
    sink_threshold: float = Field(default=DEFAULT_SINK_THRESHOLD, gt=0, le=1, description=SINK_DESCRIPTION)
    checks: list[Check] | None = None
    answer: str | None = Field(default=None, min_length=1)
    neutral_token: str | None = Field(default=None, min_length=1, description=NEUTRAL_DESCRIPTION)
    ig_steps: int = Field(default=32, ge=2, le=MAX_IG_STEPS, description=IG_STEPS_DESCRIPTION)
    exclude_filler: bool = Field(default=True, description=FILLER_DESCRIPTION)
    attention: AttentionStack | None = Field(default=None, description=TRACE_ATTENTION_DESCRIPTION)

    _answer_stop_form = model_validator(mode="before")(answer_stop_form)


class ViewLead(BaseModel):
    view: str
    measures: str = Field(description="what this view measures")
    leader: str | None = Field(description="the content segment it puts first")
    value: Rounded | None


class PromptTrace(MeasuredTrace, Report, StackReport):
    """The traced prompt's numbers (:class:`MeasuredTrace`) and what this tool says about them."""

    rendered_prompt: str = Field(description="the text the model read (chat template applied)")
    views: list[ViewLead] = Field(default_factory=list, description="what each view measures and whom it puts first")
    next_calls: list[NextCall] = Field(default_factory=list, description="calls that would confirm or refute the lead")

    @field_validator("findings")
    @classmethod
    def _round_findings(cls, findings: list[Finding]) -> list[Finding]:
        """A finding's value rounds here, at the report boundary, as a ``Rounded`` field does."""
        return [f if f.value is None else f.model_copy(update={"value": rounded(f.value)}) for f in findings]
