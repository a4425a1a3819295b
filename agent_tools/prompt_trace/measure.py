"""The traced-prompt pass and the numbers it yields: segment the prompt, run it (or generate), reduce to shares.

One pass streams three consumers: the last query's rows (per answer step), what every key receives (to find
the attention sinks) and the rollout. Only the inspector runs the model. :func:`measure` then turns the
accumulated rows into the per-segment views and leads that the report and its narrative are written from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from agent_tools.analysis.metrics import threshold_sinks
from agent_tools.analysis.segments import Lead, leading_segment, segment_shares, without_sink
from agent_tools.consumers.last_row import LastRowConsumer
from agent_tools.consumers.received import ReceivedShareConsumer
from agent_tools.consumers.rollout import RolloutConsumer
from agent_tools.consumers.segment_shares import SegmentAccumulator
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel
from agent_tools.prompt_segments import CONTENT_KINDS, SegmentedPrompt, SegmentSpec, segment_prompt
from agent_tools.prompt_trace.models import DEFAULT_SINK_THRESHOLD, Target
from agent_tools.runner import Generation
from agent_tools.schemas import ChatMessage


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
    rollout_row: Tensor  # (T,) rollout at the last prompt position
    answer_logits: Tensor | None  # (V,) next-token logits at the last prompt position (None: no LM head)
    generated_ids: list[int]
    generation: Generation | None


@dataclass
class _TracePass:
    """The consumers of one traced pass and the accumulator made once the prompt's sinks are known."""

    segmented: SegmentedPrompt
    target: Target
    sink_threshold: float
    rows: LastRowConsumer = field(default_factory=LastRowConsumer)
    received: ReceivedShareConsumer = field(default_factory=ReceivedShareConsumer)
    rollout: RolloutConsumer = field(default_factory=RolloutConsumer)
    generated_ids: list[int] = field(default_factory=list)
    prompt: SegmentedPrompt | None = None
    accumulator: SegmentAccumulator | None = None

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
        self.accumulator = SegmentAccumulator(
            prompt.segment_index(), len(prompt.segments), sink=prompt.index("sink"), generated=prompt.index("generated")
        )
        return self.accumulator

    def on_step(self, step: int, token: int) -> None:
        """Greedy generation's callback: reduce the rows of the query that chose ``token``."""
        accumulator = self.finish_prompt() if step == 0 else self.accumulator
        assert accumulator is not None
        accumulator.add(self.rows.take(self.length + step))  # the query at length - 1 + step reads that many keys
        self.generated_ids.append(token)

    def traced(self, answer_logits: Tensor | None, generation: Generation | None) -> TracedPrompt:
        if self.prompt is None or self.accumulator is None:
            raise RuntimeError("the traced pass captured no answer step")
        rollout_row = self.rollout.rollout()[self.length - 1]  # (T,)
        return TracedPrompt(
            self.target, self.prompt, self.accumulator, rollout_row, answer_logits, self.generated_ids, generation
        )


def trace_pass(
    inspector: Inspector,
    loaded: LoadedModel,
    prompt: str | list[ChatMessage],
    named: list[SegmentSpec] | None,
    *,
    target: Target = "last",
    max_new_tokens: int = 16,
    sink_threshold: float = DEFAULT_SINK_THRESHOLD,
) -> TracedPrompt:
    """Segment the prompt and run it through the inspector: one captured forward, or greedy generation."""
    segmented = check_traceable(segment_prompt(inspector, loaded, prompt, named))
    encoded = segmented.encoded
    length = encoded.length
    inspector.check_budget(3 * length * length * 4, "attention rollout over the prompt")
    run = _TracePass(segmented, target, sink_threshold)
    if target == "generate":
        generation = inspector.generate(
            loaded,
            encoded,
            max_new_tokens=max_new_tokens,
            prompt_consumers=[run.received, run.rollout],
            step_consumers=[run.rows],
            on_step=run.on_step,
        )
        return run.traced(generation.first_logits, generation)
    answer_logits = inspector.answer_logits(loaded, encoded, [run.rows, run.received, run.rollout])
    run.finish_prompt().add(run.rows.take(length))
    return run.traced(answer_logits, None)


@dataclass(frozen=True)
class TraceNumbers:
    """The per-segment views and leads of a trace: everything its report and narrative are written from.

    ``views`` holds one value per segment for ``share`` (mean over layers and heads), ``free`` (share with the
    sink set aside), ``last`` (last layer), ``rollout`` and ``rollout_free``.
    """

    head_shares: Tensor  # (L, H, S) mean over the answer steps
    views: dict[str, list[float]]
    eligible: Tensor  # (S,) bool: segments that compete for 'read most'
    lead: Lead  # by share
    last_lead: Lead  # in the last layer
    rollout_lead: Lead  # by rollout, sink set aside
    top_head: tuple[int, int, float]  # (layer, head, share) of the head that reads the leader hardest

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


def measure(traced: TracedPrompt) -> TraceNumbers:
    """Reduce the accumulated (L, H, S) shares and the rollout row to per-segment views and their leaders."""
    prompt = traced.prompt
    sink = prompt.index("sink")
    head_shares = traced.shares.mean_head_shares()  # (L, H, S)
    shares = head_shares.mean((0, 1))  # (S,)
    last_layer = head_shares[-1].mean(0)  # (S,)
    rollout_shares = segment_shares(traced.rollout_row, prompt.segment_index(), len(prompt.segments))  # (S,)
    rollout_free = without_sink(rollout_shares, sink)
    views = {
        "share": shares.tolist(),
        "free": without_sink(shares, sink).tolist(),
        "last": last_layer.tolist(),
        "rollout": rollout_shares.tolist(),
        "rollout_free": rollout_free.tolist(),
    }
    eligible = _eligible(prompt)
    lead = leading_segment(shares, eligible)
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
    )
