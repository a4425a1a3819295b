"""trace_prompt_attention: which parts of my prompt (system, user turns, named spans) does the answer read?"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from pydantic import BaseModel, Field, field_validator
from torch import Tensor

from agent_tools.analysis.rollout import RolloutConsumer
from agent_tools.analysis.segments import find_sinks, leading_segment, segment_shares, top_positions, without_sink
from agent_tools.errors import InvalidInputError
from agent_tools.generation import (
    MAX_NEW_TOKENS,
    Generation,
    LastRowConsumer,
    ReceivedShareConsumer,
    answer_forward,
    greedy_generate,
)
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel
from agent_tools.schemas import Finding, KeyWeight, ModelInput, Report, rounded
from agent_tools.segments import CONTENT_KINDS, PromptMessage, SegmentedPrompt, SegmentSpec, segment_prompt
from agent_tools.tools.registry import ToolSpec

Target = Literal["last", "generate"]
TARGETS: tuple[str, ...] = get_args(Target)
DEFAULT_SINK_THRESHOLD = 0.1
NEXT_TOKENS_SHOWN = 5

PROMPT_DESCRIPTION = (
    "plain text, or a list of chat messages [{role, content}] (roles: system, user, assistant) rendered with the "
    "model's own chat template (with the generation prompt for the assistant's answer)"
)
SEGMENTS_DESCRIPTION = (
    "extra segments to name, each a substring (text) or a character span (start, end), optionally inside one "
    "message (message index); a named span takes its tokens out of the message around it"
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
    if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens {value} out of range 1..{MAX_NEW_TOKENS}")
    return value


class TracePromptInput(ModelInput):
    prompt: str | list[PromptMessage] = Field(description=PROMPT_DESCRIPTION)
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

    _max_new_tokens_range = field_validator("max_new_tokens", mode="before")(max_new_tokens_in_range)


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


@dataclass
class SegmentAccumulator:
    """Reduces each step's (L, H, Tk) rows to segment shares at once; only these summaries are kept."""

    prompt: SegmentedPrompt
    prompt_length: int
    steps: int = 0
    head_shares: Tensor | None = None  # (L, H, S) summed over steps
    token_weights: Tensor | None = None  # (Tk_max,) summed over steps, mean over layers and heads
    step_shares: list[Tensor] = field(default_factory=list)  # (S,) per step
    step_top_keys: list[tuple[int, float]] = field(default_factory=list)

    def add(self, rows: Tensor) -> Tensor:
        """(L, H, Tk) one query's rows -> (S,) its shares (mean over layers and heads); accumulates."""
        index = self.prompt.segment_index()
        generated = self.prompt.index("generated")
        extra = rows.shape[-1] - self.prompt_length
        if extra > 0:
            assert generated is not None
            index = torch.cat([index, torch.full((extra,), generated, dtype=torch.long)])  # (Tk,)
        shares = segment_shares(rows, index, len(self.prompt.segments))  # (L, H, S)
        tokens = rows.mean((0, 1))  # (Tk,)
        self.head_shares = shares if self.head_shares is None else self.head_shares + shares
        if self.token_weights is None:
            self.token_weights = tokens
        else:
            grown = torch.zeros(max(tokens.shape[0], self.token_weights.shape[0]))
            grown[: self.token_weights.shape[0]] += self.token_weights
            grown[: tokens.shape[0]] += tokens
            self.token_weights = grown
        sink = self.prompt.index("sink")
        readable = tokens.clone()
        if sink is not None:
            readable[index == sink] = -1.0
        top = int(readable.argmax())
        self.step_top_keys.append((top, float(tokens[top])))
        self.steps += 1
        mean = shares.mean((0, 1))  # (S,)
        self.step_shares.append(mean)
        return mean

    def mean_head_shares(self) -> Tensor:
        assert self.head_shares is not None
        return self.head_shares / self.steps  # (L, H, S)

    def mean_token_weights(self) -> Tensor:
        assert self.token_weights is not None
        return self.token_weights / self.steps


@dataclass
class TraceRun:
    """A trace's report plus the next-token logits at the last prompt position (for comparisons)."""

    report: PromptTrace
    answer_logits: Tensor | None


def _short(text: str, limit: int = 80) -> str:
    text = text.replace("\n", "⏎")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _eligible(prompt: SegmentedPrompt) -> Tensor:
    """(S,) bool: segments that compete for 'read most': the prompt's content segments that hold tokens."""
    flags = [s.kind in CONTENT_KINDS and len(s.positions) > 0 for s in prompt.segments]
    if not any(flags):  # e.g. a one-token text whose only token is the sink: fall back to any non-sink segment
        flags = [s.kind != "sink" for s in prompt.segments]
    return torch.tensor(flags)


def check_traceable(prompt: SegmentedPrompt, field: str = "prompt") -> SegmentedPrompt:
    """A prompt of one token has nothing to read but itself, the attention sink: refuse it rather than guess."""
    length = prompt.encoded.length
    if length < 2:
        msg = (
            f"{field} is {length} token; tracing needs at least 2 tokens so the answer position can read "
            "something besides the first token (the attention sink)"
        )
        raise InvalidInputError(msg, field=field)
    return prompt


def trace(
    inspector: Inspector,
    loaded: LoadedModel,
    prompt: str | list[PromptMessage],
    named: list[SegmentSpec] | None,
    *,
    target: Target = "last",
    max_new_tokens: int = 16,
    top_k: int = 3,
    sink_threshold: float = DEFAULT_SINK_THRESHOLD,
) -> TraceRun:
    """Segment the prompt, run it (and generate, for target 'generate'), and build the report."""
    segmented = check_traceable(segment_prompt(inspector, loaded, prompt, named))
    encoded = segmented.encoded
    length = encoded.length
    inspector.check_budget(3 * length * length * 4, "attention rollout over the prompt")
    rows_consumer, received, rollout = LastRowConsumer(), ReceivedShareConsumer(), RolloutConsumer()
    state: dict[str, object] = {}
    generated_ids: list[int] = []

    def finish_prompt() -> SegmentAccumulator:
        sinks = find_sinks(received.received(), threshold=sink_threshold)
        with_sinks = segmented.with_sinks(sinks)
        if target == "generate":
            with_sinks = with_sinks.with_generated()
        accumulator = SegmentAccumulator(with_sinks, length)
        state["accumulator"] = accumulator
        return accumulator

    def on_step(step: int, token: int) -> None:
        accumulator = finish_prompt() if step == 0 else state["accumulator"]
        assert isinstance(accumulator, SegmentAccumulator)
        accumulator.add(rows_consumer.take(length + step))  # the query at length - 1 + step reads that many keys
        generated_ids.append(token)

    generation = None
    if target == "generate":
        generation = greedy_generate(
            inspector,
            loaded,
            encoded,
            max_new_tokens=max_new_tokens,
            prompt_consumers=[received, rollout],
            step_consumers=[rows_consumer],
            on_step=on_step,
        )
        answer_logits: Tensor | None = generation.first_logits
    else:
        answer_logits = answer_forward(inspector, loaded, encoded, [rows_consumer, received, rollout])
        finish_prompt().add(rows_consumer.take(length))
    accumulator = state["accumulator"]
    assert isinstance(accumulator, SegmentAccumulator)
    report = _build_report(
        loaded,
        accumulator,
        rollout.rollout()[length - 1],
        target=target,
        top_k=top_k,
        sink_threshold=sink_threshold,
        answer_logits=answer_logits,
        generated_ids=generated_ids,
        generation=generation,
    )
    return TraceRun(report, answer_logits)


def _token_text(loaded: LoadedModel, prompt: SegmentedPrompt, position: int, generated_ids: list[int]) -> str:
    tokens = prompt.encoded.tokens
    if position < len(tokens):
        return tokens[position].text
    return loaded.tokenizer.decode([generated_ids[position - len(tokens)]])  # type: ignore[attr-defined]


def next_token_table(loaded: LoadedModel, logits: Tensor, count: int = NEXT_TOKENS_SHOWN) -> list[TokenProbability]:
    probabilities = torch.softmax(logits.double(), -1)
    values, indices = probabilities.topk(count)
    return [
        TokenProbability(
            token=loaded.tokenizer.decode([int(i)]),  # type: ignore[attr-defined]
            token_id=int(i),
            probability=rounded(v),
        )
        for v, i in zip(values.tolist(), indices.tolist(), strict=True)
    ]


def _segment_rows(
    loaded: LoadedModel,
    accumulator: SegmentAccumulator,
    views: dict[str, list[float]],
    *,
    top_k: int,
    generated_ids: list[int],
) -> list[SegmentShare]:
    prompt, length = accumulator.prompt, accumulator.prompt_length
    sink = prompt.index("sink")
    token_weights = accumulator.mean_token_weights()
    rows = []
    for index, segment in enumerate(prompt.segments):
        positions = list(segment.positions)
        if segment.kind == "generated":  # keys the model wrote: every generated token but the last
            positions = list(range(length, length + max(len(generated_ids) - 1, 0)))
        if segment.char_start is not None and segment.char_end is not None:
            text = prompt.encoded.text[segment.char_start : segment.char_end]
        else:
            text = "".join(_token_text(loaded, prompt, p, generated_ids) for p in positions)
        top = top_positions(token_weights, [p for p in positions if p < token_weights.shape[0]], top_k)
        share = views["share"][index]
        no_rollout = segment.kind == "generated"
        rows.append(
            SegmentShare(
                name=segment.name,
                kind=segment.kind,
                message=segment.message,
                token_count=len(positions),
                positions=positions,
                text=_short(text),
                share=rounded(share),
                share_without_sink=None if index == sink else rounded(views["free"][index]),
                share_per_token=rounded(share / len(positions)) if positions else 0.0,
                last_layer_share=rounded(views["last"][index]),
                rollout_share=None if no_rollout else rounded(views["rollout"][index]),
                rollout_share_without_sink=None
                if no_rollout or index == sink
                else rounded(views["rollout_free"][index]),
                top_tokens=[
                    KeyWeight(position=p, token=_token_text(loaded, prompt, p, generated_ids), weight=rounded(w))
                    for p, w in top
                ],
            )
        )
    return rows


def _generated_rows(
    loaded: LoadedModel, accumulator: SegmentAccumulator, eligible: Tensor, generated_ids: list[int]
) -> list[GeneratedToken]:
    prompt, names = accumulator.prompt, accumulator.prompt.names
    rows = []
    steps = zip(generated_ids, accumulator.step_shares, accumulator.step_top_keys, strict=True)
    for step, (token_id, step_shares, (key, key_weight)) in enumerate(steps):
        step_lead = leading_segment(step_shares, eligible)
        rows.append(
            GeneratedToken(
                step=step,
                position=accumulator.prompt_length - 1 + step,
                token=loaded.tokenizer.decode([token_id]),  # type: ignore[attr-defined]
                token_id=token_id,
                read_most=names[step_lead.best],
                read_most_share=rounded(float(step_shares[step_lead.best])),
                shares={n: rounded(v) for n, v in zip(names, step_shares.tolist(), strict=True)},
                top_key=KeyWeight(
                    position=key, token=_token_text(loaded, prompt, key, generated_ids), weight=rounded(key_weight)
                ),
            )
        )
    return rows


def _peaks(accumulator: SegmentAccumulator, eligible: Tensor, generated: list[GeneratedToken]) -> list[Finding]:
    """Per content segment, the generated token that read it most, against its mean over the answer.

    Sorted by peak / mean, so a segment read in one burst (a value being copied) comes first; at most 3.
    """
    if len(generated) < 2:
        return []
    names = accumulator.prompt.names
    per_step = torch.stack(accumulator.step_shares)  # (steps, S)
    mean = per_step.mean(0)  # (S,)
    peak_values, peak_steps = per_step.max(0)  # (S,) each
    rows = []
    for index in torch.nonzero(eligible).flatten().tolist():
        if mean[index] <= 0:
            continue
        step, value = int(peak_steps[index]), float(peak_values[index])
        ratio = value / float(mean[index])
        detail = (
            f"{names[index]!r} is read most while writing {generated[step].token!r} (step {step}): {value:.1%}, "
            f"{ratio:.1f}× its mean {float(mean[index]):.1%}"
        )
        rows.append(
            (ratio, Finding(kind="peak", position=generated[step].position, value=rounded(value), detail=detail))
        )
    rows.sort(key=lambda row: -row[0])
    return [finding for _, finding in rows[:3]]


def _build_report(
    loaded: LoadedModel,
    accumulator: SegmentAccumulator,
    rollout_row: Tensor,
    *,
    target: Target,
    top_k: int,
    sink_threshold: float,
    answer_logits: Tensor | None,
    generated_ids: list[int],
    generation: Generation | None,
) -> PromptTrace:
    prompt = accumulator.prompt
    length = accumulator.prompt_length
    names = prompt.names
    tokens = prompt.encoded.tokens
    answer = length - 1
    sink, template = prompt.index("sink"), prompt.index("template")
    head_shares = accumulator.mean_head_shares()  # (L, H, S)
    num_layers, num_heads = head_shares.shape[0], head_shares.shape[1]
    shares = head_shares.mean((0, 1))  # (S,)
    last_layer = head_shares[-1].mean(0)  # (S,)
    rollout_shares = segment_shares(rollout_row, prompt.segment_index(), len(names))  # (S,)
    rollout_free = without_sink(rollout_shares, sink)
    views = {
        "share": shares.tolist(),
        "free": without_sink(shares, sink).tolist(),
        "last": last_layer.tolist(),
        "rollout": rollout_shares.tolist(),
        "rollout_free": rollout_free.tolist(),
    }
    share, free = views["share"], views["free"]

    eligible = _eligible(prompt)
    lead = leading_segment(shares, eligible)
    best = names[lead.best]
    runner_up = names[lead.runner_up] if lead.runner_up is not None else None
    last_lead = leading_segment(last_layer, eligible)
    rollout_eligible = eligible & torch.tensor([s.kind != "generated" for s in prompt.segments])
    rollout_lead = leading_segment(rollout_free, rollout_eligible if rollout_eligible.any() else eligible)
    last_best, rollout_best = names[last_lead.best], names[rollout_lead.best]
    last_value, rollout_value = views["last"][last_lead.best], views["rollout_free"][rollout_lead.best]

    findings: list[Finding] = []
    reader = "the answer" if target == "generate" else f"position {answer} {tokens[answer].text!r}"
    findings.append(
        Finding(
            kind="read_most",
            value=rounded(share[lead.best]),
            detail=f"{reader} reads {best!r} most: {share[lead.best]:.1%} of its attention (mean over "
            f"{num_layers} layers × {num_heads} heads), {free[lead.best]:.1%} with the sink set aside",
        )
    )
    if lead.runner_up is not None:
        findings.append(
            Finding(
                kind="runner_up",
                value=rounded(share[lead.runner_up]),
                detail=f"next is {runner_up!r} with {share[lead.runner_up]:.1%}, {lead.margin * 100:.1f} points less",
            )
        )
    if sink is not None:
        sink_positions = prompt.segments[sink].positions
        sink_tokens = ", ".join(f"{p} {tokens[p].text!r}" for p in sink_positions)
        findings.append(
            Finding(
                kind="sink",
                position=sink_positions[0],
                token=tokens[sink_positions[0]].text,
                value=rounded(share[sink]),
                detail=f"the sink ({sink_tokens}) takes {share[sink]:.1%} of the attention; it is kept apart",
            )
        )
    per_head = head_shares[..., lead.best]  # (L, H)
    top_layer, top_head = divmod(int(per_head.argmax()), num_heads)
    head_value = float(per_head[top_layer, top_head])
    findings.append(
        Finding(
            kind="top_head",
            layer=top_layer,
            head=top_head,
            value=rounded(head_value),
            detail=f"L{top_layer}H{top_head} reads {best!r} hardest: {head_value:.1%} of its attention",
        )
    )
    findings.append(
        Finding(
            kind="last_layer",
            layer=num_layers - 1,
            value=rounded(last_value),
            detail=f"in the last layer alone {last_best!r} leads with {last_value:.1%}",
        )
    )
    findings.append(
        Finding(
            kind="rollout",
            position=answer,
            value=rounded(rollout_value),
            detail=f"by rollout at position {answer}, {rollout_best!r} leads with {rollout_value:.1%} once the sink "
            f"is set aside (raw {views['rollout'][rollout_lead.best]:.2%})",
        )
    )
    template_wins = template is not None and share[template] > share[lead.best]
    if template is not None and template_wins:
        findings.append(
            Finding(
                kind="template",
                value=rounded(share[template]),
                detail=f"the chat template's own tokens take {share[template]:.1%}, more than {best!r}",
            )
        )

    generated = _generated_rows(loaded, accumulator, eligible, generated_ids) if target == "generate" else None
    generated_text = None
    peaks: list[Finding] = []
    if generated is not None:
        generated_text = loaded.tokenizer.decode(generated_ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        counts: dict[str, int] = {}
        for item in generated:
            counts[item.read_most] = counts.get(item.read_most, 0) + 1
        favourite, times = max(counts.items(), key=lambda kv: kv[1])
        findings.append(
            Finding(
                kind="tokens_read_most",
                value=float(times),
                detail=f"{times} of {len(generated)} generated tokens read {favourite!r} most",
            )
        )
        peaks = _peaks(accumulator, eligible, generated)
        findings.extend(peaks)

    if generated is not None and generation is not None:
        end = "EOS" if generation.stopped == "eos" else "max_new_tokens"
        summary = f"Generating {generated_text!r} ({len(generated)} tokens, stopped at {end}), the answer read "
        summary += f"{best!r} most: {share[lead.best]:.1%} of its attention (mean over {num_layers} layers × "
        summary += f"{num_heads} heads, and over the generated tokens)"
    else:
        summary = f"At the last prompt position {answer} {tokens[answer].text!r}, the model reads {best!r} most: "
        summary += f"{share[lead.best]:.1%} of its attention (mean over {num_layers} layers × {num_heads} heads)"
    if lead.runner_up is not None:
        summary += f", {lead.margin * 100:.1f} points over {runner_up!r} ({share[lead.runner_up]:.1%})."
    else:
        summary += "; it is the only content segment (name spans with segments to split it)."
    if sink is not None:
        summary += f" The sink ({len(prompt.segments[sink].positions)} token(s) from position 0) took "
        summary += f"{share[sink]:.1%}; without it {best!r} has {free[lead.best]:.1%}."
    summary += f" Last layer: {last_best!r} {last_value:.1%}; rollout (sink set aside): {rollout_best!r} "
    summary += f"{rollout_value:.1%}."
    if template is not None and template_wins:
        summary += f" The template's own tokens took {share[template]:.1%}."
    written = prompt.index("generated")
    if written is not None:
        summary += f" The answer's own earlier tokens took {share[written]:.1%}."
    if generated:
        favourite_count = sum(1 for g in generated if g.read_most == best)
        summary += f" {favourite_count} of {len(generated)} generated tokens read {best!r} most."
        if peaks:
            summary += f" Sharpest peak: {peaks[0].detail}."
    elif answer_logits is not None:
        table = next_token_table(loaded, answer_logits, 1)[0]
        summary += f" Next token: {table.token!r} ({table.probability:.1%})."

    return PromptTrace(
        model=loaded.name,
        summary=summary,
        findings=findings,
        target=target,
        prompt_format=prompt.prompt_format,
        rendered_prompt=prompt.encoded.text,
        num_tokens=length,
        answer_position=answer,
        segments=_segment_rows(loaded, accumulator, views, top_k=top_k, generated_ids=generated_ids),
        sink_positions=list(prompt.segments[sink].positions) if sink is not None else [],
        sink_threshold=sink_threshold,
        read_most=best,
        runner_up=runner_up,
        margin=rounded(lead.margin),
        next_tokens=next_token_table(loaded, answer_logits) if answer_logits is not None else None,
        generated_text=generated_text,
        generated=generated,
        stopped=generation.stopped if generation is not None else None,
        seconds_per_token=rounded(s) if generation is not None and (s := generation.seconds_per_token) else None,
    )


def trace_prompt_attention(inspector: Inspector, args: TracePromptInput) -> PromptTrace:
    """Which parts of a prompt the answer reads: attention shares per segment (roles, turns, named spans).

    The prompt is split into segments (system#1, user#1, assistant#1, ..., the chat template's own tokens, the
    spans you name, and the sink tokens kept apart); the attention of the last prompt position — or of every
    token the model generates greedily — is summed per segment: averaged over layers and heads, in the last
    layer, and by rollout. Reports the top tokens read in each segment and, per generated token, the segment
    it read most.
    """
    loaded = inspector.model(args.model)
    return trace(
        inspector,
        loaded,
        args.prompt,
        args.segments,
        target=args.target,
        max_new_tokens=args.max_new_tokens,
        top_k=args.top_k,
        sink_threshold=args.sink_threshold,
    ).report


SPEC = ToolSpec(
    name="trace_prompt_attention",
    description=(
        "Trace which parts of a prompt the answer reads: split a text or chat (system, user/assistant turns, "
        "template tokens, spans you name) into segments and report each segment's share of the attention of the "
        "answer position — or of every token the model generates — averaged over layers and heads, in the last "
        "layer and by rollout, with attention-sink tokens kept apart, the top tokens read in each segment, and "
        "which segment was read most and by how much."
    ),
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
)
