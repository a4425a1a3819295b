"""The prompt trace's report models, targets and the argument descriptions the prompt tools share."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, Field

from agent_tools.inspector import MAX_NEW_TOKENS
from agent_tools.schemas import KeyWeight, NextCall, Report
from agent_tools.stack_input import StackReport

Target = Literal["last", "generate"]
TARGETS: tuple[str, ...] = get_args(Target)
DEFAULT_SINK_THRESHOLD = 0.1
Check = Literal["causal", "gradient", "value"]
CHECKS: tuple[str, ...] = get_args(Check)
DEFAULT_CHECKS: tuple[Check, ...] = ("causal", "value")
MAX_IG_STEPS = 256

PROMPT_DESCRIPTION = "text, or chat messages [{role, content}] (rendered with the model's chat template)"
TARGET_DESCRIPTION = "generate: trace every token the model generates"
SINK_DESCRIPTION = (
    "a token read by at least 4 later queries that receives, on average over them and all layers and heads, at "
    "least this share of their attention (and 2× what uniform attention would give it) joins position 0 in the "
    "'sink' segment"
)


CHECKS_DESCRIPTION = (
    "evidence per segment: causal (answer's Δ log p without it), value (‖α·v·W_O‖ share), gradient (integrated "
    "gradients, slow); omitted = causal, value"
)
ANSWER_DESCRIPTION = "the answer the checks measure (mind a leading space); omitted = the model's own"
NEUTRAL_DESCRIPTION = (
    "the single token that replaces a segment's tokens in the neutral replacement and the gradient baseline; "
    "omitted = a space, else '.', else the tokenizer's unknown or padding token"
)
IG_STEPS_DESCRIPTION = f"integration steps of integrated gradients with check 'gradient' (2..{MAX_IG_STEPS})"
FILLER_DESCRIPTION = (
    "set filler and secondary sinks (tokens read by many queries well above uniform that write little: small "
    "‖v·W_O‖) apart from 'read most' and from each segment's top tokens"
)


def max_new_tokens_in_range(value: object) -> object:
    """Field validator (mode 'before'): an out-of-range count gets the same message as the inspector's check."""
    if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens {value} out of range 1..{MAX_NEW_TOKENS}")
    return value


class TokenShare(BaseModel):
    position: int
    token: str
    share: float = Field(description="share of the answer's attention on this token (mean over layers and heads)")
    value_share: float | None = Field(default=None, description="its share of ‖α·v·W_O‖ (what it writes)")
    filler: bool = Field(default=False, description="a filler / secondary-sink token (read like a sink, writes little)")


class CausalEffect(BaseModel):
    """How the answer's log-probability changes when the segment is taken out (nats; negative = it mattered)."""

    first_token_removed: float = Field(description="Δ log p(first answer token), segment removed")
    first_token_neutral: float = Field(description="Δ log p(first answer token), segment replaced by neutral tokens")
    answer_removed: float = Field(description="Δ Σ log p(answer tokens), teacher-forced, segment removed")
    answer_neutral: float = Field(description="Δ Σ log p(answer tokens), segment replaced by neutral tokens")
    top_token_changed_removed: bool = Field(description="the most likely first answer token differs when removed")
    top_token_changed_neutral: bool
    effect: float = Field(
        description="how much the answer depends on the segment: −(answer_removed + answer_neutral) / 2, nats"
    )


class GradientAttribution(BaseModel):
    integrated_gradients: float = Field(
        description="Σ over the segment's tokens of integrated gradients of log p(answer) w.r.t. the input "
        "embeddings, from the neutral-token baseline (nats; the segments' sum ≈ log p(input) − log p(baseline))"
    )
    gradient_x_input: float = Field(description="Σ over the segment's tokens of gradient · embedding")


class FillerToken(BaseModel):
    position: int
    token: str
    segment: str
    received_ratio: float = Field(description="what later queries give it (mean) / what uniform attention would")
    relative_value_norm: float = Field(description="its ‖v·W_O‖ / the text's median token's (mean over layers)")
    share: float = Field(description="share of the answer's attention it takes")


class RankAgreement(BaseModel):
    measure_a: str
    measure_b: str
    spearman: float | None = Field(description="rank correlation over the segments (1 same order, −1 reversed)")
    same_top: bool = Field(description="both measures put the same segment first")


class ViewLead(BaseModel):
    view: str
    measures: str = Field(description="what this view measures")
    leader: str | None = Field(description="the content segment it puts first")
    value: float | None


class AnswerEvidence(BaseModel):
    text: str
    token_ids: list[int]
    tokens: list[str]
    source: Literal["model", "given"] = Field(description="the model's own answer, or the one given as 'answer'")
    logprob: float = Field(description="Σ log p of its tokens after the clean prompt, teacher-forced")
    first_token_logprob: float


class GradientRun(BaseModel):
    steps: int
    baseline: str = Field(description="what the integration starts from")
    value: float = Field(description="log p(answer) at the input")
    baseline_value: float = Field(description="log p(answer) at the baseline")
    delta: float = Field(description="convergence delta: Σ attributions − (value − baseline_value)")
    relative_delta: float = Field(description="|delta| / |value − baseline_value|: raise ig_steps when large")


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
    top_tokens: list[KeyWeight] = Field(
        description="most-read content tokens inside the segment (mean over layers, heads); filler only when the "
        "segment holds nothing else"
    )
    uniform_share: float | None = Field(
        default=None, description="the share uniform attention over the prompt would give it: token_count / tokens"
    )
    content_share: float | None = Field(
        default=None, description="share with the sink and the filler set aside (renormalised): what 'read most' ranks"
    )
    filler_share: float | None = Field(default=None, description="part of share that falls on its filler tokens")
    value_share: float | None = Field(
        default=None, description="value-weighted share ‖α·v·W_O‖ (mean over layers and heads): what it writes"
    )
    token_shares: list[TokenShare] = Field(
        default_factory=list, description="the segment's most-read tokens, filler included and flagged (up to 16)"
    )
    causal: CausalEffect | None = Field(default=None, description="check 'causal' (content segments)")
    gradient: GradientAttribution | None = Field(default=None, description="check 'gradient' (content segments)")


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


class PromptTrace(Report, StackReport):
    target: Target
    prompt_format: Literal["text", "messages"]
    rendered_prompt: str = Field(description="the text the model read (chat template applied)")
    num_tokens: int
    answer_position: int = Field(description="the last prompt position")
    segments: list[SegmentShare]
    sink_positions: list[int]
    sink_threshold: float
    read_most: str = Field(
        description="the prompt content segment read most (not sink, template or generated; by content_share when "
        "filler is set apart)"
    )
    runner_up: str | None
    margin: float = Field(
        description="read_most minus runner_up, on the share read_most is ranked by (mean over layers and heads)"
    )
    next_tokens: list[TokenProbability] | None = Field(
        default=None, description="the model's top next tokens at the last prompt position"
    )
    generated_text: str | None = None
    generated: list[GeneratedToken] | None = None
    stopped: Literal["eos", "max_new_tokens"] | None = None
    seconds_per_token: float | None = Field(default=None, description="wall time per KV-cache step, with capture")
    checks: list[Check] = Field(default_factory=list, description="the evidence checks that ran")
    answer_evidence: AnswerEvidence | None = Field(default=None, description="the answer the checks measured")
    neutral_token: str | None = Field(default=None, description="the token segments were replaced with")
    depends_on_most: str | None = Field(
        default=None, description="the content segment the answer depends on most (largest causal effect)"
    )
    depends_on_runner_up: str | None = None
    agreement: list[RankAgreement] = Field(
        default_factory=list, description="rank agreement between attention, value-weighted, causal and gradient"
    )
    measures_agree: bool | None = Field(
        default=None, description="attention and the causal effect put the same segment first"
    )
    filler: list[FillerToken] = Field(default_factory=list, description="filler / secondary sinks set apart")
    gradient_run: GradientRun | None = None
    views: list[ViewLead] = Field(default_factory=list, description="what each view measures and whom it puts first")
    evidence_notes: list[str] = Field(default_factory=list, description="checks skipped, and why")
    next_calls: list[NextCall] = Field(default_factory=list, description="calls that would confirm or refute the lead")
