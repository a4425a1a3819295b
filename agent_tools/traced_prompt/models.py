"""The traced prompt's number models, targets and the argument descriptions both prompt tools share.

:class:`MeasuredTrace` is one traced prompt's numbers without words: ``compare_prompts`` embeds one per variant,
and ``trace_prompt_attention``'s report is it plus the summary, findings, views and next calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, Field

from agent_tools.inspector import MAX_NEW_TOKENS
from agent_tools.schemas import ChatMessage, KeyWeight, Rounded, Rounded6, TokenRow
from agent_tools.segment_attribution import CausalAttribution

Target = Literal["last", "generate"]
AnswerStop = Literal["line", "eos", "sentence", "tokens"]
ANSWER_STOPS: tuple[str, ...] = get_args(AnswerStop)
DEFAULT_ANSWER_STOP: AnswerStop = "line"
Direction = Literal["depends_on", "works_against", "negligible"]
SegmentTier = Literal["named", "gap", "inserted", "other"]
NEGLIGIBLE_NATS = 0.1  # |Δ log p| below this (p changes by under ~10%) is worded "barely moves"
AGREEMENT_RHO = 0.5  # attention "agrees" with removal: the same top named segment and Spearman ρ at least this
DEFAULT_SINK_THRESHOLD = 0.1
Check = Literal["causal", "gradient", "value"]
CHECKS: tuple[Check, ...] = get_args(Check)
DEFAULT_CHECKS: tuple[Check, ...] = ("causal", "value")
MAX_IG_STEPS = 256


def messages_argument(messages: Sequence[ChatMessage | dict]) -> list[dict[str, Any]]:
    """Chat messages as a follow-up call's argument: plain dicts."""
    return [dict(m) if isinstance(m, dict) else m.model_dump() for m in messages]


def prompt_argument(prompt: str | Sequence[ChatMessage]) -> str | list[dict[str, Any]]:
    """A prompt as a follow-up call's argument: the text, or the messages as plain dicts."""
    return prompt if isinstance(prompt, str) else messages_argument(prompt)


def generation_arguments(target: Target, answer_stop: AnswerStop, max_new_tokens: int) -> dict[str, Any]:
    """target, and for 'generate' the stop rule and cap, so a follow-up call measures the same answer."""
    if target != "generate":
        return {"target": target}
    return {"target": target, "answer_stop": answer_stop, "max_new_tokens": max_new_tokens}


ANSWER_STOP_DESCRIPTION = "line: turn end or first line break; tokens: max_new_tokens"
SINK_DESCRIPTION = (
    "a token read by at least 4 later queries that receives, on average over them and all layers and heads, at "
    "least this share of their attention (and 2× what uniform attention would give it) joins position 0 in the "
    "'sink' segment"
)


NEUTRAL_DESCRIPTION = (
    "the single token that replaces a segment's tokens in the neutral replacement and the gradient baseline; "
    "omitted = a space, else '.', else the tokenizer's unknown or padding token"
)
IG_STEPS_DESCRIPTION = f"integration steps of integrated gradients with check 'gradient' (2..{MAX_IG_STEPS})"
FILLER_DESCRIPTION = (
    "set filler and secondary sinks (tokens read by many queries well above uniform that write little: small "
    "‖v·W_O‖) apart from 'read most' and from each segment's top tokens"
)


def answer_stop_form(data: object) -> object:
    """Model validator (mode 'before'): ``answer_stop: "tokens N"`` is ``answer_stop: "tokens"`` with
    ``max_new_tokens: N``; any other value is left to the enum check (which names the valid values)."""
    if not isinstance(data, dict):
        return data
    stop = data.get("answer_stop")
    if isinstance(stop, str) and stop.strip().startswith("tokens ") and stop.split()[1:2]:
        count = stop.split()[1]
        if not count.isdigit():
            raise ValueError(f"answer_stop {stop!r}: give 'tokens N' with a whole number N, or one of {ANSWER_STOPS}")
        given = data.get("max_new_tokens")
        if given is not None and given != int(count):
            msg = f"answer_stop {stop!r} and max_new_tokens {given} disagree; give the count once"
            raise ValueError(msg)
        return {**data, "answer_stop": "tokens", "max_new_tokens": int(count)}
    return data


def max_new_tokens_in_range(value: object) -> object:
    """Field validator (mode 'before'): an out-of-range count gets the same message as the inspector's check."""
    if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens {value} out of range 1..{MAX_NEW_TOKENS}")
    return value


MaxNewTokens = Annotated[
    int,
    Field(ge=1, le=MAX_NEW_TOKENS, description="answer tokens at most"),
    BeforeValidator(max_new_tokens_in_range),
]
"""The answer's token cap both prompt tools take (``max_new_tokens``; an out-of-range count gets the inspector's
message)."""


class TokenShare(TokenRow):
    share: Rounded = Field(description="share of the answer's attention on this token (mean over layers and heads)")
    value_share: Rounded | None = Field(default=None, description="its share of ‖α·v·W_O‖ (what it writes)")
    filler: bool = Field(default=False, description="a filler / secondary-sink token (read like a sink, writes little)")


class CausalEffect(BaseModel):
    """Δ log p(answer) when the segment is removed (nats): negative = the answer depends on it, positive = the
    segment works against the answer. The neutral replacement (same length, positions kept) is a second ablation."""

    removed: Rounded = Field(
        description="Δ log p of the deciding token when the segment is removed (the number rankings and summary use)"
    )
    direction: Direction = Field(
        description=f"depends_on (removed < -{NEGLIGIBLE_NATS}), works_against (> +{NEGLIGIBLE_NATS}), else negligible"
    )
    per_token_removed: list[Rounded] = Field(
        default_factory=list, description="Δ log p of each answer token when removed (answer_evidence.tokens order)"
    )
    first_token_removed: Rounded = Field(description="Δ log p(first answer token), segment removed")
    first_token_neutral: Rounded = Field(description="Δ log p(first answer token), segment replaced by neutral tokens")
    answer_removed: Rounded = Field(description="Δ Σ log p(answer tokens), teacher-forced, segment removed")
    answer_neutral: Rounded = Field(description="Δ Σ log p(answer tokens), segment replaced by neutral tokens")
    top_token_changed_removed: bool = Field(description="the most likely first answer token differs when removed")
    top_token_changed_neutral: bool


class GradientAttribution(BaseModel):
    integrated_gradients: Rounded = Field(
        description="Σ over the segment's tokens of integrated gradients of log p(answer) w.r.t. the input "
        "embeddings, from the neutral-token baseline (nats; the segments' sum ≈ log p(input) − log p(baseline))"
    )
    gradient_x_input: Rounded = Field(description="Σ over the segment's tokens of gradient · embedding")


class FillerToken(TokenRow):
    segment: str
    received_ratio: Rounded = Field(description="what later queries give it (mean) / what uniform attention would")
    relative_value_norm: Rounded = Field(description="its ‖v·W_O‖ / the text's median token's (mean over layers)")
    share: Rounded = Field(description="share of the answer's attention it takes")


class RankAgreement(BaseModel):
    measure_a: str
    measure_b: str
    spearman: Rounded | None = Field(description="rank correlation over the named segments (1 same order, −1 reversed)")
    same_top: bool = Field(description="both measures put the same named segment first")


class AnswerToken(BaseModel):
    step: int = Field(description="0 = first answer token")
    token: str
    logprob: Rounded = Field(description="log p of the token after the clean prompt and the answer before it")
    moved_most_by: str | None = Field(description="the named segment whose removal moves this token's log p most")
    removed: Rounded | None = Field(description="Δ log p of this token when that segment is removed")


class AnswerEvidence(BaseModel):
    text: str = Field(description="exactly the answer the checks measured (teacher-forced)")
    token_ids: list[int]
    tokens: list[str] = Field(description="the exact tokens measured")
    source: Literal["model", "given"] = Field(description="the model's own answer, or the one given as 'answer'")
    covers: str = Field(description="what the measured answer is, in words (target 'last': one token)")
    logprob: Rounded = Field(description="Σ log p of its tokens after the clean prompt, teacher-forced")
    first_token_logprob: Rounded
    per_token: list[AnswerToken] = Field(default_factory=list, description="each measured token and what moves it")


class SegmentEffect(BaseModel):
    segment: str
    removed: Rounded = Field(description="Δ log p when the segment is removed (negative: the answer depends on it)")
    direction: Direction


class DecidingToken(BaseModel):
    """The answer token whose log-probability the named segments' removal moves most: what decides the answer."""

    step: int
    token: str
    logprob: Rounded
    effects: list[SegmentEffect] = Field(description="every named segment's removal effect on it, largest |Δ| first")


class GradientRun(BaseModel):
    steps: int
    baseline: str = Field(description="what the integration starts from")
    value: Rounded = Field(description="log p(answer) at the input")
    baseline_value: Rounded = Field(description="log p(answer) at the baseline")
    delta: Rounded6 = Field(description="convergence delta: Σ attributions − (value − baseline_value)")
    relative_delta: Rounded = Field(description="|delta| / |value − baseline_value|: raise ig_steps when large")


class SegmentShare(BaseModel):
    name: str = Field(
        description="role and turn (system#1, user#2), a named span, inserted#1 (added by the chat template), "
        "template, sink, generated, text"
    )
    kind: str
    tier: SegmentTier = Field(
        default="other",
        description="named: a span you named or a whole message (ranked, headlined); gap: the unnamed text between "
        "named spans; inserted: text the chat template added; other: sink, markers, special, generated",
    )
    message: int | None = Field(default=None, description="0-based message index the segment lies in")
    token_count: int
    positions: list[int] = Field(description="token positions in the segment (generated: keys written by the model)")
    text: str = Field(description="the segment's text, shortened")
    share: Rounded = Field(
        description="share of attention the target reads here, mean over all layers and heads "
        "(target 'generate': also averaged over the generated tokens)"
    )
    share_without_sink: Rounded | None = Field(description="share once the sink is set aside (renormalised)")
    share_per_token: Rounded = Field(description="share / token_count: how densely the segment is read")
    last_layer_share: Rounded = Field(description="share in the last layer alone (mean over its heads)")
    rollout_share: Rounded | None = Field(
        description="share by attention rollout at the last prompt position (None for generated tokens)"
    )
    rollout_share_without_sink: Rounded | None = Field(
        description="rollout share renormalised without the sink (in a causal model rollout drains into position 0)"
    )
    top_tokens: list[KeyWeight] = Field(
        description="most-read content tokens inside the segment (mean over layers, heads); filler only when the "
        "segment holds nothing else"
    )
    uniform_share: Rounded | None = Field(
        default=None, description="the share uniform attention over the prompt would give it: token_count / tokens"
    )
    content_share: Rounded | None = Field(
        default=None, description="share with the sink and the filler set aside (renormalised over every segment)"
    )
    named_share: Rounded | None = Field(
        default=None,
        description="share of the attention on the named segments (sink, filler, template, gaps set aside): what "
        "'read most' ranks and the summary prints",
    )
    filler_share: Rounded | None = Field(default=None, description="part of share that falls on its filler tokens")
    value_share: Rounded | None = Field(
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
    probability: Rounded


class GeneratedToken(BaseModel):
    step: int = Field(description="0 = first answer token")
    position: int = Field(description="the query position whose attention chose this token")
    token: str
    token_id: int
    read_most: str = Field(description="prompt content segment this token's attention read most")
    read_most_share: Rounded
    shares: dict[str, Rounded] = Field(description="share per segment, mean over layers and heads")
    top_key: KeyWeight = Field(description="the single non-sink token read most (mean over layers and heads)")


class MeasuredTrace(BaseModel):
    """One traced prompt's numbers: every segment's shares and check results, the answer and what decides it.

    No words: the summary, findings, views and next calls are ``trace_prompt_attention``'s, which adds them (and
    the rendered prompt) to these fields; ``compare_prompts`` embeds one of these per variant."""

    target: Target
    prompt_format: Literal["text", "messages"]
    num_tokens: int
    answer_position: int = Field(description="the last prompt position")
    segments: list[SegmentShare]
    sink_positions: list[int]
    sink_threshold: float
    read_most: str = Field(description="the named segment read most (by named_share)")
    runner_up: str | None
    margin: Rounded = Field(description="read_most minus runner_up, in named_share")
    next_tokens: list[TokenProbability] | None = Field(
        default=None, description="the model's top next tokens at the last prompt position"
    )
    generated_text: str | None = None
    generated: list[GeneratedToken] | None = None
    answer_stop: AnswerStop | None = Field(default=None, description="where generation was asked to end")
    stopped: Literal["eos", "max_new_tokens", "line", "sentence"] | None = Field(
        default=None, description="why generation ended: end of turn, the cap, a line break, a sentence end"
    )
    seconds_per_token: Rounded | None = Field(default=None, description="wall time per KV-cache step, with capture")
    checks: list[Check] = Field(default_factory=list, description="the evidence checks that ran")
    answer_evidence: AnswerEvidence | None = Field(default=None, description="the answer the checks measured")
    neutral_token: str | None = Field(default=None, description="the token segments were replaced with")
    deciding_token: DecidingToken | None = Field(
        default=None, description="the answer token the segments move most, and each named segment's effect on it"
    )
    depends_on_most: str | None = Field(
        default=None,
        description="the named segment whose removal lowers the deciding token's log p most (None: none lowers it)",
    )
    depends_on_runner_up: str | None = None
    works_against_most: str | None = Field(
        default=None, description="the named segment whose removal raises the deciding token's log p most"
    )
    moves_most: str | None = Field(default=None, description="the named segment with the largest |Δ| either way")
    agreement: list[RankAgreement] = Field(
        default_factory=list,
        description="rank agreement over the named segments: attention, value-weighted, |Δ| removed, gradient",
    )
    measures_agree: bool | None = Field(
        default=None,
        description=f"attention and removal agree: the same top named segment (by share and by |Δ|) and Spearman ρ "
        f">= {AGREEMENT_RHO} (None: fewer than two named segments or no causal check)",
    )
    filler: list[FillerToken] = Field(default_factory=list, description="filler / secondary sinks set apart")
    gradient_run: GradientRun | None = None
    evidence_notes: list[str] = Field(default_factory=list, description="checks skipped, and why")
    causal_attribution: CausalAttribution | None = Field(
        default=None, description="more than 4 segments: how attribution chose the segments ablated exactly"
    )


SEGMENT_RANK_LABEL = "segments you named first, then |Δ log p removed| where the causal check ran, then share"


def segment_rank(row: SegmentShare) -> float:
    """How ``detail: "summary"`` ranks segments: the ones the caller named always kept (first), then by removal's
    magnitude where the causal check ran (above any unchecked row), else by attention share."""
    named = 1e6 if row.kind == "named" else 0.0
    return named + (1.0 + abs(row.causal.removed) if row.causal is not None else row.share)
