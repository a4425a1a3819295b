"""The traced-prompt pass and the numbers it yields: segment the prompt, run it (or generate), reduce to shares.

One pass streams three consumers: the last query's rows (per answer step), what every key receives (to find
the attention sinks) and the rollout; with value-weighted evidence a fourth, the same rows weighted by what each
key writes (‖α·v·W_O‖) and every key's value norm. Only the inspector runs the model. :func:`measure` then turns
the accumulated rows into the per-segment views and leads that the report and its narrative are written from,
setting apart filler and secondary sinks (read like a sink, writing little) from what the answer "reads most".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from agent_tools.analysis.attribution import content_shares, filler_positions, relative_value_norms
from agent_tools.analysis.metrics import Received, threshold_sinks, without_sink
from agent_tools.analysis.segments import Lead, leading_segment, segment_shares
from agent_tools.capture import AttentionConsumer
from agent_tools.consumers.cross_rows import CrossRowsConsumer
from agent_tools.consumers.last_row import LastRowConsumer
from agent_tools.consumers.received import ReceivedShareConsumer
from agent_tools.consumers.rollout import RolloutConsumer
from agent_tools.consumers.segment_shares import SegmentAccumulator
from agent_tools.consumers.value_rows import ValueRowConsumer
from agent_tools.encoding import answer_input
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel
from agent_tools.prompt_segments import CONTENT_KINDS, Segment, SegmentedPrompt
from agent_tools.runner import Generation, StopRule
from agent_tools.runner.attribution import TracedAnswer
from agent_tools.schemas import ROLES
from agent_tools.traced_prompt.models import SegmentTier, Target


def segment_tier(segment: Segment) -> SegmentTier:
    """named: a span the caller named or a whole message (what rankings and headlines are about); gap: the unnamed
    rest of a message or text that holds named spans; inserted: text the chat template added; other: the rest."""
    if segment.kind == "named":
        return "named"
    if segment.kind in ROLES or segment.kind == "text":
        return "gap" if segment.gap else "named"
    if segment.kind == "inserted":
        return "inserted"
    return "other"


def check_traceable(prompt: SegmentedPrompt, *, field: str = "prompt") -> SegmentedPrompt:
    """A prompt of one token has nothing to read but itself, the attention sink: refuse it rather than guess."""
    length = prompt.encoded.length
    if length < 2:
        msg = (
            f"{field} is {length} token; tracing needs at least 2 tokens so the answer position can read "
            "something besides the first token (the attention sink)"
        )
        raise InvalidInputError(msg, field=field)
    return prompt


@dataclass(frozen=True)
class TracedPrompt:
    """What one traced pass measured, before any report is written."""

    target: Target
    prompt: SegmentedPrompt  # with the sink segment (and, for 'generate', the generated one)
    shares: SegmentAccumulator  # per-step segment shares of the answer's attention
    rollout_row: Tensor  # (T,) rollout at the last prompt position (on the CPU, like every tensor here)
    answer_logits: Tensor | None  # (V,) next-token logits at the last prompt position (None: no LM head)
    generated_ids: list[int]
    generation: Generation | None
    received: Received | None = None  # what every prompt key received over the prompt forward (sink, filler)
    value_shares: SegmentAccumulator | None = None  # the same steps, value-weighted (None: not asked / no W_O)
    key_norms: Tensor | None = None  # (L, T) mean over heads of each prompt key's ‖v_j W_O^h‖
    answer_pass: TracedAnswer | None = None  # the prompt forward's logits and KV cache, kept for the causal checks
    stack: str = "self"  # "cross": an encoder–decoder's answer reading its input (seq2seq_trace_pass)


@dataclass
class _TracePass:
    """The consumers of one traced pass and the accumulator made once the prompt's sinks are known."""

    segmented: SegmentedPrompt
    target: Target
    sink_threshold: float
    rows: LastRowConsumer = field(default_factory=LastRowConsumer)
    received: ReceivedShareConsumer = field(default_factory=ReceivedShareConsumer)
    rollout: RolloutConsumer = field(default_factory=RolloutConsumer)
    values: ValueRowConsumer | None = None
    generated_ids: list[int] = field(default_factory=list)
    prompt: SegmentedPrompt | None = None
    accumulator: SegmentAccumulator | None = None
    value_accumulator: SegmentAccumulator | None = None

    @property
    def length(self) -> int:
        return self.segmented.encoded.length

    def finish_prompt(self) -> SegmentAccumulator:
        """After the prompt forward: set the sinks apart and start accumulating the answer's rows."""
        sinks = threshold_sinks(self.received.received(), threshold=self.sink_threshold)
        prompt = self.segmented.with_sinks(sinks)
        if self.target == "generate":
            prompt = prompt.with_generated()
        self.prompt = prompt
        self.accumulator = self._accumulator(prompt)
        self.value_accumulator = self._accumulator(prompt) if self.values is not None else None
        return self.accumulator

    @staticmethod
    def _accumulator(prompt: SegmentedPrompt) -> SegmentAccumulator:
        return SegmentAccumulator(
            prompt.segment_index(), len(prompt.segments), sink=prompt.index("sink"), generated=prompt.index("generated")
        )

    def add_step(self, keys: int) -> None:
        """Reduce the rows of the query that reads ``keys`` keys (and their value-weighted twins)."""
        assert self.accumulator is not None
        self.accumulator.add(self.rows.take(keys))
        if self.values is not None and self.value_accumulator is not None:
            self.value_accumulator.add(self.values.take(keys))

    def on_step(self, step: int, token: int) -> None:
        """Greedy generation's callback: reduce the rows of the query that chose ``token``."""
        if step == 0:
            self.finish_prompt()
        self.add_step(self.length + step)  # the query at length - 1 + step reads that many keys
        self.generated_ids.append(token)

    def traced(
        self, answer_logits: Tensor | None, generation: Generation | None, kept: TracedAnswer | None = None
    ) -> TracedPrompt:
        if self.prompt is None or self.accumulator is None:
            raise RuntimeError("the traced pass captured no answer step")
        # (T,) the rollout at the last prompt position: the one row of the (T, T) product that crosses to the CPU
        rollout_row = self.rollout.rollout()[self.length - 1].cpu()
        return TracedPrompt(
            self.target,
            self.prompt,
            self.accumulator,
            rollout_row,
            answer_logits,
            self.generated_ids,
            generation,
            received=self.received.received(),
            value_shares=self.value_accumulator,
            key_norms=self.values.prompt_norms() if self.values is not None else None,
            answer_pass=kept,
        )


def trace_pass(
    inspector: Inspector,
    loaded: LoadedModel,
    segmented: SegmentedPrompt,
    *,
    target: Target,
    max_new_tokens: int,
    sink_threshold: float,
    stop_when: StopRule | None,
    value_grams: dict[int, Tensor] | None,
    keep_cache: bool,
) -> TracedPrompt:
    """Run a segmented prompt (validated by :func:`check_traceable`, the rollout's memory checked) through the
    inspector: one captured forward, or greedy generation (``stop_when`` ends it).

    ``value_grams`` (layer -> (H, D, D) output-projection Grams) adds the value-weighted rows and key norms;
    ``keep_cache`` keeps the prompt forward's KV cache (target 'last') so the causal checks need not run the clean
    prompt again.
    """
    encoded = segmented.encoded
    run = _TracePass(segmented, target, sink_threshold)
    run.values = ValueRowConsumer(value_grams) if value_grams is not None else None
    step_consumers = [run.rows] + ([run.values] if run.values is not None else [])
    if target == "generate":
        generation = inspector.generate(
            loaded,
            encoded,
            max_new_tokens=max_new_tokens,
            prompt_consumers=[run.received, run.rollout],
            step_consumers=step_consumers,
            on_step=run.on_step,
            stop_when=stop_when,
        )
        return run.traced(generation.first_logits, generation)
    consumers: list[AttentionConsumer] = [*step_consumers, run.received, run.rollout]
    kept = inspector.traced_answer(loaded, encoded, consumers) if keep_cache else None
    answer_logits = kept.logits if kept is not None else inspector.answer_logits(loaded, encoded, consumers)
    run.finish_prompt()
    run.add_step(run.length)
    return run.traced(answer_logits, None, kept)


def seq2seq_trace_pass(
    inspector: Inspector,
    loaded: LoadedModel,
    segmented: SegmentedPrompt,
    *,
    target: Target,
    max_new_tokens: int,
    sink_threshold: float,
    stop_when: StopRule | None,
) -> TracedPrompt:
    """An encoder–decoder's trace: which part of the input each answer token's cross-attention read.

    The model answers greedily (one token for target 'last', up to ``max_new_tokens`` for 'generate'); one
    teacher-forced pass over the answer captures the cross-attention rows (row i chose answer token i), and an
    encoder pass gives the encoder's rollout. Sinks are the input tokens the cross-attention reads whatever the
    answer token. The rollout view is defined for cross-attention as the answer rows' cross-attention (mean over
    steps, decoder layers and heads) carried back to the input through the encoder's rollout — every decoder layer
    reads the same encoder output, whose position j' mixes the inputs by rollout row j' — the decoder's own
    self-attention mixing left out.
    """
    encoded = segmented.encoded
    steps = max_new_tokens if target == "generate" else 1
    generation = inspector.generate(loaded, encoded, max_new_tokens=steps, stop_when=stop_when)
    cross = inspector.attention_stack(loaded, "cross")
    decoded = encoded.on_stack(cross.name, answer_input(loaded, encoded, generation))
    rows = CrossRowsConsumer()
    inspector.run(loaded, decoded, [rows], need_output=False)
    rollout = RolloutConsumer()
    inspector.run(loaded, encoded.on_stack("encoder"), [rollout], need_output=False)
    received = rows.received()
    prompt = segmented.with_sinks(threshold_sinks(received, threshold=sink_threshold))
    accumulator = _TracePass._accumulator(prompt)
    kept = rows.rows()  # (L, H, n, Tk): one row per answer token
    for step in range(kept.shape[2]):
        accumulator.add(kept[:, :, step])
    carried = kept.mean((0, 1, 2)) @ rollout.rollout().cpu().float()  # (Tk,) through the encoder's rollout
    return TracedPrompt(
        target,
        prompt,
        accumulator,
        carried,
        generation.first_logits,
        generation.token_ids if target == "generate" else [],
        generation if target == "generate" else None,
        received=received,
        stack="cross",
    )


@dataclass(frozen=True)
class TraceNumbers:
    """The per-segment views and leads of a trace: everything its report and narrative are written from.

    ``views`` holds one value per segment for ``share`` (mean over layers and heads), ``free`` (share with the
    sink set aside), ``last`` (last layer), ``rollout``, ``rollout_free``, ``content`` (share with the sink and
    the filler set aside, renormalised), ``filler`` (the segment's share on its filler tokens), ``uniform`` (what
    uniform attention over the prompt would give it), ``named`` (the content share renormalised over the named
    segments: what 'read most' ranks), ``named_uniform`` (uniform attention on that scale) and, with value
    evidence, ``value`` (‖α·v·W_O‖ shares).
    """

    head_shares: Tensor  # (L, H, S) mean over the answer steps
    views: dict[str, list[float]]
    eligible: Tensor  # (S,) bool: content segments (what the checks measure)
    lead: Lead  # among the named segments, by named share (filler, sink, template and gaps set aside)
    last_lead: Lead  # in the last layer
    rollout_lead: Lead  # by rollout, sink set aside
    top_head: tuple[int, int, float]  # (layer, head, share) of the head that reads the leader hardest
    token_weights: Tensor  # (Tk,) attention per key
    value_token_weights: Tensor | None  # (Tk,) value-weighted share per key
    filler: list[int]  # filler / secondary-sink positions (not the sink segment)
    filler_ratio: Tensor | None  # (T,) received / uniform, per prompt token
    relative_norms: Tensor | None  # (T,) ‖v W_O‖ relative to the text's median token
    exclude_filler: bool
    ranked: Tensor  # (S,) bool: the named segments
    tiers: list[SegmentTier]

    @property
    def num_layers(self) -> int:
        return int(self.head_shares.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.head_shares.shape[1])


def _eligible(prompt: SegmentedPrompt) -> Tensor:
    """(S,) bool: segments that compete for 'read most': the prompt's content segments that hold tokens."""
    flags = [s.kind in CONTENT_KINDS and len(s.positions) > 0 for s in prompt.segments]
    if not any(flags):  # e.g. a one-token text whose only token is the sink: fall back to any non-sink segment
        flags = [s.kind != "sink" for s in prompt.segments]
    return torch.tensor(flags)


def key_segments(prompt: SegmentedPrompt, keys: int) -> Tensor:
    """(keys,) segment of every key: the prompt's tokens, then ``generated`` for keys the model wrote."""
    index = prompt.segment_index()
    extra = keys - index.shape[0]
    generated = prompt.index("generated")
    if extra > 0 and generated is not None:
        index = torch.cat([index, torch.full((extra,), generated, dtype=torch.long)])
    return index[:keys]


@dataclass(frozen=True)
class _Filler:
    positions: list[int]
    ratio: Tensor | None  # (T,)
    norms: Tensor | None  # (T,)


def find_filler(traced: TracedPrompt) -> _Filler:
    """Filler and secondary sinks among the content tokens: read like a sink by many queries, writing little."""
    prompt, received, norms = traced.prompt, traced.received, traced.key_norms
    if received is None or norms is None:
        return _Filler([], None, None)
    length = prompt.encoded.length
    content = torch.tensor([prompt.segments[s].kind in CONTENT_KINDS for s in prompt.token_segment])  # (T,)
    sink = prompt.index("sink")
    not_sink = (
        torch.tensor([s != sink for s in prompt.token_segment])
        if sink is not None
        else torch.ones(length, dtype=torch.bool)
    )
    ratio = received.total[:length] / received.uniform[:length].clamp_min(1e-12)
    relative = relative_value_norms(norms[:, :length], not_sink)
    found = filler_positions(ratio, received.readers[:length], relative, content & not_sink)
    return _Filler(found, ratio, relative)


def _content_view(prompt: SegmentedPrompt, token_weights: Tensor, filler: list[int]) -> tuple[list[float], list[float]]:
    """(S,) share renormalised without the sink and the filler; (S,) each segment's raw share on filler tokens."""
    keys = token_weights.shape[0]
    index = key_segments(prompt, keys)
    sink = prompt.index("sink")
    excluded = index == sink if sink is not None else torch.zeros(keys, dtype=torch.bool)
    filler_mask = torch.zeros(keys, dtype=torch.bool)
    filler_mask[torch.tensor(filler, dtype=torch.long)] = True
    content = content_shares(token_weights, index, len(prompt.segments), excluded | filler_mask)
    on_filler = segment_shares(torch.where(filler_mask, token_weights, 0.0), index, len(prompt.segments))
    return content.tolist(), on_filler.tolist()


def measure(traced: TracedPrompt, *, exclude_filler: bool = True) -> TraceNumbers:
    """Reduce the accumulated (L, H, S) shares and the rollout row to per-segment views and their leaders.

    With ``exclude_filler`` the segment read most is the one whose content (not sink, not filler) takes most.
    """
    prompt = traced.prompt
    sink = prompt.index("sink")
    head_shares = traced.shares.mean_head_shares()  # (L, H, S)
    shares = head_shares.mean((0, 1))  # (S,)
    last_layer = head_shares[-1].mean(0)  # (S,)
    rollout_shares = segment_shares(traced.rollout_row, prompt.segment_index(), len(prompt.segments))  # (S,)
    rollout_free = without_sink(rollout_shares, sink)
    token_weights = traced.shares.mean_token_weights()
    filler = find_filler(traced)
    content, on_filler = _content_view(prompt, token_weights, filler.positions)
    views = {
        "share": shares.tolist(),
        "free": without_sink(shares, sink).tolist(),
        "last": last_layer.tolist(),
        "rollout": rollout_shares.tolist(),
        "rollout_free": rollout_free.tolist(),
        "content": content,
        "filler": on_filler,
        "uniform": [len(s.positions) / prompt.encoded.length for s in prompt.segments],
    }
    value_weights = traced.value_shares.mean_token_weights() if traced.value_shares is not None else None
    if traced.value_shares is not None:
        views["value"] = traced.value_shares.mean_head_shares().mean((0, 1)).tolist()
    eligible = _eligible(prompt)
    tiers = [segment_tier(s) for s in prompt.segments]
    ranked = eligible & torch.tensor([t == "named" for t in tiers])
    ranked = ranked if bool(ranked.any()) else eligible
    base = torch.tensor(content) if exclude_filler else torch.tensor(views["free"])  # (S,)
    on_ranked = torch.where(ranked, base, torch.zeros_like(base))
    named = on_ranked / on_ranked.sum().clamp_min(1e-12)  # (S,) renormalised over the named segments
    filler_set = set(filler.positions) if exclude_filler else set()
    counts = torch.tensor(
        [sum(1 for p in s.positions if p not in filler_set) for s in prompt.segments], dtype=torch.float64
    )
    ranked_counts = torch.where(ranked, counts, torch.zeros_like(counts))
    views["named"] = named.tolist()
    views["named_uniform"] = (ranked_counts / ranked_counts.sum().clamp_min(1)).tolist()
    lead = leading_segment(named, ranked)
    rollout_eligible = eligible & torch.tensor([s.kind != "generated" for s in prompt.segments])
    per_head = head_shares[..., lead.best]  # (L, H)
    top_layer, top_head = divmod(int(per_head.argmax()), head_shares.shape[1])
    return TraceNumbers(
        head_shares=head_shares,
        views=views,
        eligible=eligible,
        lead=lead,
        last_lead=leading_segment(last_layer, eligible),
        rollout_lead=leading_segment(rollout_free, rollout_eligible if rollout_eligible.any() else eligible),
        top_head=(top_layer, top_head, float(per_head[top_layer, top_head])),
        token_weights=token_weights,
        value_token_weights=value_weights,
        filler=filler.positions,
        filler_ratio=filler.ratio,
        relative_norms=filler.norms,
        exclude_filler=exclude_filler,
        ranked=ranked,
        tiers=tiers,
    )
