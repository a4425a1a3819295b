"""The inspector: the facade every tool calls — the session, encoding, validation and the model's passes.

Every surface (CLI, LangChain, MCP, OpenAI-style dispatch) calls the tools, and every tool an :class:`Inspector`.
It is a :class:`~agent_tools.session.Session` (policy, model cache, limits, budgets, artifacts) that also
tokenises (:mod:`agent_tools.encoding`), checks indices and stacks, and starts the passes that need the session's
limits (query chunks, rows that fit the budget) in :mod:`agent_tools.runner`, the only code that calls a model.
Other runner passes run under :func:`~agent_tools.session.guarded` (the model's lock and the call's checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from agent_tools import encoding, runner
from agent_tools.capture import AttentionConsumer
from agent_tools.encoding import Encoded
from agent_tools.encoding import check_unicode as check_unicode
from agent_tools.encoding import validate_text as validate_text
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.intervene import AblationMethod
from agent_tools.loading import LoadedModel
from agent_tools.runner import attribution as evidence
from agent_tools.runner import attribution_patching, edge_attribution, edge_patching, patching, replay
from agent_tools.runner.readout import Readout
from agent_tools.session import CallContext as CallContext
from agent_tools.session import Session, call_checkpoint, guarded
from agent_tools.session import call_scope as call_scope
from agent_tools.session import current_call as current_call
from agent_tools.session import text_digest as text_digest

if TYPE_CHECKING:
    from agent_tools.families import StackFacts

MAX_NEW_TOKENS = 256
# Answer tokens an encoder–decoder's decoder reads when a per-layer tool looks at its decoder or cross stack.
DECODER_TOKENS = 16
# Items any one list argument may hold. Every list a tool takes is bounded by the model (layers, heads: the largest
# models have a few thousand heads) or by sense (messages, segments, temperatures); the cap keeps a hostile request
# of 100,000 items from costing seconds of validation before the model's own bound is checked.
MAX_LIST_ITEMS = 4096

Result = TypeVar("Result")
Next = TypeVar("Next")


@dataclass
class PassPlan(Generic[Result]):
    """A tool's share of one forward pass: the consumers to stream into, then ``finish(output)`` builds the result.

    A tool that declares its pass this way can share it: :meth:`Inspector.run_together` runs plans over the same
    input and layers in one forward pass (the ``analyze`` job), instead of one pass each.
    ``encoded = None`` means the plan needs no pass; ``finish`` gets the model's output, or None when no plan of
    the pass asked for it.
    """

    loaded: LoadedModel
    encoded: Encoded | None
    consumers: list[AttentionConsumer]
    finish: Callable[[Any], Result]
    layers: list[int] | None = None
    need_output: bool = False
    record_inputs: bool = False

    def then(self, step: Callable[[Result], Next]) -> PassPlan[Next]:
        """The same pass, its result handed on to ``step``."""
        finish = self.finish
        return PassPlan(
            self.loaded, self.encoded, self.consumers, lambda output: step(finish(output)),
            self.layers, self.need_output, self.record_inputs,
        )  # fmt: skip

    def shares_pass_with(self, other: PassPlan[Any]) -> bool:
        """Same model, same tokens and mask, same layers: one forward pass serves both."""
        if self.encoded is None or other.encoded is None or self.loaded is not other.loaded:
            return False
        mine, theirs = self.encoded.decoder, other.encoded.decoder
        default = self.loaded.facts.default_stack  # a stack of None is the model's default stack
        return (
            self.layers == other.layers
            and (self.encoded.stack or default) == (other.encoded.stack or default)
            and torch.equal(self.encoded.input_ids, other.encoded.input_ids)
            and torch.equal(self.encoded.attention_mask, other.encoded.attention_mask)
            and (mine is None) == (theirs is None)
            and (mine is None or theirs is None or torch.equal(mine.input_ids, theirs.input_ids))
        )


def check_index(value: int, count: int, name: str, *, where: str = "") -> int:
    """A layer/head index in 0..count-1; negative or too large gives an error naming the range.

    ``where`` ends the message (e.g. " of the decoder stack": encoder and decoder depths may differ).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{name} must be an integer in 0..{count - 1}{where}, got {value!r}", field=name)
    if not 0 <= value < count:
        raise InvalidInputError(f"{name} {value} out of range 0..{count - 1}{where}", field=name)
    return value


def check_indices(values: Sequence[int] | None, count: int, name: str, *, where: str = "") -> list[int]:
    """A list of indices (None = all); duplicates and out-of-range values are refused.

    Linear, and bounded by ``count`` first: a list longer than the range must repeat or overrun, so it is refused
    before any item is looked at (100,000 layers took 73 s with the old pairwise duplicate count).
    """
    if values is None:
        return list(range(count))
    items = list(values)
    if not items:
        raise InvalidInputError(
            f"{name} is an empty list; give indices in 0..{count - 1} or omit it for all", field=name
        )
    if len(items) > count:
        msg = f"{name} lists {len(items):,} items but there are only {count}; give each index in 0..{count - 1} once"
        raise InvalidInputError(msg, field=name)
    seen: set[int] = set()
    duplicates: set[int] = set()
    for value in items:
        check_index(value, count, name, where=where)
        (duplicates if value in seen else seen).add(value)
    if duplicates:
        raise InvalidInputError(
            f"{name} lists duplicates {sorted(duplicates)}; give each index in 0..{count - 1} once", field=name
        )
    return items


def check_list_lengths(arguments: Any, *, limit: int = MAX_LIST_ITEMS) -> None:
    """Refuse any list inside raw arguments (at any depth) holding more than ``limit`` items, before validation.

    Surfaces that take requests from outside (the MCP server, ``call --json``) run this first: validation and the
    tools' own checks then only ever see lists of a sane size. Iterative, so deeply nested input costs no recursion.
    """
    pending: list[tuple[str, Any]] = [("arguments", arguments)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, dict):
            pending.extend((key if path == "arguments" else f"{path}.{key}", item) for key, item in value.items())
        elif isinstance(value, list):
            if len(value) > limit:
                top = path.split(".")[0].split("[")[0]
                msg = f"{path} lists {len(value):,} items; at most {limit:,} are accepted in one list"
                raise InvalidInputError(msg, field=None if top == "arguments" else top)
            pending.extend((f"{path}[{index}]", item) for index, item in enumerate(value))


def check_new_tokens(value: int) -> int:
    """``max_new_tokens`` in 1..MAX_NEW_TOKENS, or an error naming the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NEW_TOKENS:
        msg = f"max_new_tokens {value!r} out of range 1..{MAX_NEW_TOKENS}"
        raise InvalidInputError(msg, field="max_new_tokens")
    return value


def stack_where(loaded: LoadedModel, stack: StackFacts) -> str:
    """The end of a range error: ' of the decoder stack' on an encoder–decoder, nothing on a single-stack model."""
    return f" of the {stack.name} stack" if loaded.facts.is_encoder_decoder else ""


class Inspector(Session):
    """The session (:class:`~agent_tools.session.Session`) as the tools use it: encode, check, run."""

    # --- tokenising ---------------------------------------------------------------------------------
    render_messages = staticmethod(encoding.render_messages)

    def encode(self, loaded: LoadedModel, text: str, *, add_special_tokens: bool = True) -> Encoded:
        """Tokenise with offsets, enforcing the token limit (the model's positions or the session's)."""
        return encoding.encode(loaded, text, limit=self.limit_for(loaded), add_special_tokens=add_special_tokens)

    def explains(self, loaded: LoadedModel, encoded: Encoded) -> None:
        """Record ``encoded`` as the input this call explains, for a tool whose passes do not go through
        :meth:`run` (patching a clean/corrupted pair): the report's attention-path gap is measured on it."""
        self._ran(loaded, encoded.input_ids, encoded.attention_mask, None)

    # --- validation -----------------------------------------------------------------------------------
    def check_layer(self, loaded: LoadedModel, layer: int, stack: StackFacts) -> int:
        """A layer index of ``stack``, or an error naming that stack's range."""
        return check_index(layer, stack.num_layers, "layer", where=stack_where(loaded, stack))

    def check_head(self, loaded: LoadedModel, head: int, stack: StackFacts) -> int:
        return check_index(head, stack.num_heads, "head", where=stack_where(loaded, stack))

    def check_layers(
        self, loaded: LoadedModel, layers: Sequence[int] | None, stack: StackFacts, name: str
    ) -> list[int]:
        """A list of ``stack``'s layers (None = all of them)."""
        return check_indices(layers, stack.num_layers, name, where=stack_where(loaded, stack))

    def check_heads(self, loaded: LoadedModel, heads: Sequence[int] | None, stack: StackFacts, name: str) -> list[int]:
        return check_indices(heads, stack.num_heads, name, where=stack_where(loaded, stack))

    # --- attention stacks -----------------------------------------------------------------------------
    def attention_stack(
        self, loaded: LoadedModel, attention: str | None, *, seq2seq_default: str = "encoder"
    ) -> StackFacts:
        """The stack a tool looks at: ``attention`` checked against the model's stacks; None = the default
        ("self", or ``seq2seq_default`` for an encoder–decoder)."""
        facts = loaded.facts
        name = attention if attention is not None else (seq2seq_default if facts.is_encoder_decoder else "self")
        valid = [stack.name for stack in facts.stacks]
        if name not in valid:
            kind = (
                "an encoder–decoder: its stacks are 'encoder', 'decoder' and 'cross'"
                if facts.is_encoder_decoder
                else "a single-stack model: its one attention stack is 'self'"
            )
            msg = f"model {loaded.name!r} has no {name!r} attention ({kind}); use attention = one of {valid}"
            raise InvalidInputError(msg, field="attention")
        return facts.stack(name)

    def require_stack(self, loaded: LoadedModel, stack: StackFacts, allowed: Sequence[str], why: str) -> None:
        """Refuse a stack a tool has no meaning on (``why`` says what the tool needs), naming the ones it takes."""
        if stack.name in allowed:
            return
        usable = [s.name for s in loaded.facts.stacks if s.name in allowed]
        where = f"use attention = one of {usable}" if usable else "it has none of the stacks this tool takes"
        msg = f"attention={stack.name!r}: {why}; on {loaded.name!r} {where}"
        raise InvalidInputError(msg, field="attention")

    def require_two_keys(self, encoded: Encoded, stack: StackFacts, why: str) -> None:
        """On a causal stack, refuse an input of fewer than 2 keys (``why``: what the tool needs them for)."""
        keys = len(encoded.key_tokens)
        if stack.is_causal and keys < 2:
            what = "the model's answer (what the decoder reads)" if stack.name == "decoder" else "text"
            raise InvalidInputError(f"{what} is {keys} token; {why}", field="text")

    def encode_on(
        self, loaded: LoadedModel, text: str, stack: StackFacts, *, max_new_tokens: int | None = None
    ) -> Encoded:
        """:meth:`encode`, to be captured on ``stack``: for an encoder–decoder's decoder and cross stacks the
        model first answers greedily and the decoder reads that answer (see :meth:`on_stack`)."""
        return self.on_stack(loaded, self.encode(loaded, text), stack, max_new_tokens=max_new_tokens)

    def on_stack(
        self, loaded: LoadedModel, encoded: Encoded, stack: StackFacts, *, max_new_tokens: int | None = None
    ) -> Encoded:
        """``encoded`` captured on ``stack``; the decoder and cross stacks run the decoder teacher-forced on the
        model's own greedy answer (up to ``max_new_tokens``, default :data:`DECODER_TOKENS`): row i of those maps
        is the query that chose answer token i."""
        if stack.name not in ("decoder", "cross"):
            return encoded.on_stack(stack.name)
        if not loaded.facts.is_language_model:
            msg = (
                f"model {loaded.name!r} has no next-token head, so it cannot answer and its decoder has nothing to "
                "read; the decoder and cross stacks need an encoder–decoder with its language-model head (e.g. "
                "...ForConditionalGeneration): use attention='encoder'"
            )
            raise InvalidInputError(msg, field="attention")
        answer = self.generate(loaded, encoded, max_new_tokens=max_new_tokens or DECODER_TOKENS)
        return encoded.on_stack(stack.name, encoding.answer_input(loaded, encoded, answer))

    # --- running --------------------------------------------------------------------------------------
    def run(
        self,
        loaded: LoadedModel,
        encoded: Encoded,
        consumers: Sequence[AttentionConsumer],
        *,
        layers: Sequence[int] | None = None,
        record_inputs: bool = False,
        need_output: bool = True,
    ) -> Any:
        """One forward pass with capture; returns the model's output. Holds the model's lock throughout.

        With ``need_output=False`` (the caller only wants what its consumers collect) the pass skips the
        language-model head and stops right after the last captured layer; it returns None.
        """
        decoder = encoded.decoder
        self._ran(loaded, encoded.input_ids, encoded.attention_mask, decoder.input_ids if decoder else None)
        return runner.captured_forward(
            loaded,
            encoded.input_ids,
            encoded.attention_mask,
            consumers,
            stack=encoded.stack,
            decoder_input_ids=decoder.input_ids if decoder is not None else None,
            layers=layers,
            query_chunk=self.query_chunk(loaded, max(encoded.length, decoder.length if decoder else 0)),
            record_inputs=record_inputs,
            need_output=need_output,
            checkpoint=call_checkpoint(),
        )

    def recorded_attention_calls(self, loaded: LoadedModel) -> AbstractContextManager[replay.RecordedCalls]:
        """Inside the block, the passes keep each attention module's call for :meth:`replay_together` (within a
        quarter of the memory budget; layers past it are not kept, and their replay falls back to a pass)."""
        return replay.recorded_attention_calls(loaded, limit_bytes=self.memory_budget // 4)

    def replay_together(self, plans: Sequence[PassPlan[Any]], calls: replay.RecordedCalls) -> bool:
        """Run plans that share a pass over ONE layer and need no model output from that layer's recorded call
        (no forward of the layers before it); False when they cannot be replayed (run them as a pass instead)."""
        lead = plans[0]
        single = lead.layers is not None and len(lead.layers) == 1
        if lead.encoded is None or not single or any(plan.need_output for plan in plans):
            return False
        if lead.encoded.decoder is not None or not all(lead.shares_pass_with(plan) for plan in plans[1:]):
            return False
        assert lead.layers is not None
        self._ran(lead.loaded, lead.encoded.input_ids, lead.encoded.attention_mask, None)
        return replay.replayed_layer(
            lead.loaded,
            calls,
            lead.layers[0],
            [consumer for plan in plans for consumer in plan.consumers],
            input_shape=tuple(lead.encoded.input_ids.shape),
            query_chunk=self.query_chunk(lead.loaded, lead.encoded.length),
            record_inputs=any(plan.record_inputs for plan in plans),
            checkpoint=call_checkpoint(),
        )

    def answer_logits(
        self, loaded: LoadedModel, encoded: Encoded, consumers: Sequence[AttentionConsumer] = ()
    ) -> torch.Tensor | None:
        """A captured forward of a prompt; the (V,) next-token logits at its last position (None: no LM head)."""
        self._ran(loaded, encoded.input_ids, encoded.attention_mask, None)
        return runner.answer_logits(
            loaded,
            encoded.input_ids,
            encoded.attention_mask,
            consumers,
            query_chunk=self.query_chunk(loaded, encoded.length),
            checkpoint=call_checkpoint(),
        )

    def generate(
        self,
        loaded: LoadedModel,
        encoded: Encoded,
        *,
        max_new_tokens: int,
        prompt_consumers: Sequence[AttentionConsumer] = (),
        step_consumers: Sequence[AttentionConsumer] = (),
        on_step: Callable[[int, int], None] | None = None,
        stop_when: runner.StopRule | None = None,
    ) -> runner.Generation:
        """Greedy generation under capture (see :func:`agent_tools.runner.greedy_generate`), after checking that
        the model can generate and that prompt + ``max_new_tokens`` fit the token limit. ``stop_when`` (token ids
        so far -> a stop reason or None) ends the answer early, e.g. at its first line break.

        An encoder–decoder answers with :func:`agent_tools.runner.seq2seq_generate` (encoder once, decoder steps
        on the cache); it takes no consumers: its maps come from a teacher-forced pass over the answer
        (:meth:`on_stack`).
        """
        check_new_tokens(max_new_tokens)
        self._ran(loaded, encoded.input_ids, encoded.attention_mask, None)
        if not loaded.facts.is_language_model:
            msg = f"model {loaded.name!r} has no next-token head, so it cannot generate; use target='last'"
            raise InvalidInputError(msg, field="target")
        if loaded.facts.is_encoder_decoder:
            if prompt_consumers or step_consumers or on_step is not None:
                raise ValueError("an encoder–decoder generates without consumers; capture a teacher-forced pass")
            return runner.seq2seq_generate(
                loaded,
                encoded.input_ids,
                encoded.attention_mask,
                max_new_tokens=max_new_tokens,
                checkpoint=call_checkpoint(),
                stop_when=stop_when,
            )
        limit = self.limit_for(loaded)
        if encoded.length + max_new_tokens > limit:
            msg = (
                f"prompt of {encoded.length} tokens + max_new_tokens {max_new_tokens} exceeds {limit} tokens for "
                f"{loaded.name!r}; use max_new_tokens <= {max(limit - encoded.length, 0)}"
            )
            raise ResourceLimitError(msg, field="max_new_tokens")
        return runner.greedy_generate(
            loaded,
            encoded.input_ids,
            max_new_tokens=max_new_tokens,
            query_chunk=self.query_chunk(loaded, encoded.length),
            prompt_consumers=prompt_consumers,
            step_consumers=step_consumers,
            on_step=on_step,
            checkpoint=call_checkpoint(),
            stop_when=stop_when,
        )

    def ablate(
        self,
        loaded: LoadedModel,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        heads: Sequence[tuple[int, int]],
        *,
        method: AblationMethod = "zero",
        clean: torch.Tensor | None = None,
        resample_ids: torch.Tensor | None = None,
    ) -> runner.AblationEffect:
        """Clean (unless given) and head-ablated forwards (see :func:`agent_tools.runner.ablated_forward`).

        The passes run the model's own attention, so the call's checkpoint goes in as pre-hooks on the attention
        modules, registered only while this call holds the model's lock.
        """
        self._ran(loaded, input_ids, attention_mask, None)
        with guarded(loaded):
            return runner.ablated_forward(
                loaded, input_ids, attention_mask, heads, method=method, clean=clean, resample_ids=resample_ids
            )

    def ablated_rows(
        self,
        loaded: LoadedModel,
        input_ids: torch.Tensor,
        rows: Sequence[runner.HeadSetAblation],
        *,
        replacements: dict,
        reduce: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
        logits_to_keep: int | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """What ``reduce`` keeps of the clean output and of each head set's ablated output, the sets batched as
        rows (see :func:`agent_tools.runner.ablated_rows`; ``logits_to_keep``: only the last positions' logits)."""
        length = int(input_ids.shape[-1])
        max_rows = patching.rows_per_batch(loaded, length, self.memory_budget, output_positions=logits_to_keep)
        with guarded(loaded):
            return runner.ablated_rows(
                loaded,
                input_ids,
                rows,
                replacements=replacements,
                reduce=reduce,
                max_rows=max_rows,
                logits_to_keep=logits_to_keep,
            )

    def execute(self, plan: PassPlan[Result]) -> Result:
        """Run one plan on its own: its forward pass (if any), then its finish."""
        return plan.finish(None if plan.encoded is None else self.run_together([plan]))

    def run_together(self, plans: Sequence[PassPlan[Any]]) -> Any:
        """One forward pass streaming into every plan's consumers; returns the output for their ``finish``.

        The plans must share a pass (:meth:`PassPlan.shares_pass_with`); the output is the model's when any
        plan needs it, else None.
        """
        lead = plans[0]
        if lead.encoded is None or not all(lead.shares_pass_with(plan) for plan in plans[1:]):
            raise ValueError("run_together needs plans over the same model, input and layers")
        return self.run(
            lead.loaded,
            lead.encoded,
            [consumer for plan in plans for consumer in plan.consumers],
            layers=lead.layers,
            record_inputs=any(plan.record_inputs for plan in plans),
            need_output=any(plan.need_output for plan in plans),
        )

    # --- evidence -------------------------------------------------------------------------------------
    # Causal and gradient checks beside attention: each sizes its rows or refuses by the session's budget, then
    # runs agent_tools.runner.attribution / patching / attribution_patching / edge_attribution under guarded()
    # (runner.attribution.segment_ablations, sized by its caller's segments, runs under guarded() directly).
    def traced_answer(
        self, loaded: LoadedModel, encoded: Encoded, consumers: Sequence[AttentionConsumer] = ()
    ) -> evidence.TracedAnswer:
        """:meth:`answer_logits` that also keeps the prompt's KV cache for the causal checks."""
        self._ran(loaded, encoded.input_ids, encoded.attention_mask, None)
        return evidence.traced_answer(
            loaded,
            encoded.input_ids,
            consumers,
            query_chunk=self.query_chunk(loaded, encoded.length),
            checkpoint=call_checkpoint(),
        )

    def input_gradients(
        self, loaded: LoadedModel, ids: list[int], baseline: list[int], answer: list[int], *, steps: int
    ) -> evidence.InputGradients:
        """Integrated gradients and gradient × input, rows per forward chosen so activations fit the budget."""
        per_row = self.check_gradient_budget(loaded, len(ids))
        rows = max(1, min(steps, self.memory_budget // per_row))
        with guarded(loaded):
            return evidence.input_gradients(loaded, ids, baseline, answer, steps=steps, batch_rows=rows)

    def patched_outputs(
        self,
        loaded: LoadedModel,
        encoded: Encoded,
        patches: Sequence[patching.HeadPatch],
        *,
        readout: Readout,
        sources: dict[int, torch.Tensor] | None = None,
        keep_last: bool = True,
        prefix: int = 0,
    ) -> tuple[torch.Tensor, ...]:
        """What ``readout`` keeps of R patched variants of one input, batched so each batch's activations and output
        fit the budget (see :mod:`agent_tools.runner.patching`, :mod:`agent_tools.runner.readout`)."""
        positions = 1 if keep_last else encoded.length
        rows = patching.rows_per_batch(loaded, encoded.length, self.memory_budget, output_positions=positions)
        with guarded(loaded):
            return patching.patched_outputs(
                loaded, encoded.input_ids, patches, readout=readout, sources=sources, keep_last=keep_last,
                max_rows=rows, prefix=prefix,
            )  # fmt: skip

    def attribution_passes(
        self,
        loaded: LoadedModel,
        clean: Encoded,
        corrupted: Encoded,
        metric: attribution_patching.Metric,
        *,
        grad_drop: bool,
        field: str = "method",
        saturation_fix: bool = True,
    ) -> attribution_patching.AttributionPasses:
        """Attribution patching's clean pass and corrupted pass with a backward (rows: 1, or 1 + L with GradDrop),
        refused when the backward's activations would not fit the budget."""
        rows = 1 + (loaded.facts.num_layers if grad_drop else 0)
        held = evidence.gradient_bytes(loaded, corrupted.length) * rows
        what = f"attribution patching's backward over {corrupted.length} tokens × {rows} rows"
        advice = "use method 'exact', a shorter pair" + (" or grad_drop false" if grad_drop else "")
        self.check_budget(held, what, of="activations", advice=advice, field=field)
        with guarded(loaded):
            return attribution_patching.attribution_passes(
                loaded,
                clean.input_ids,
                corrupted.input_ids,
                metric,
                grad_drop=grad_drop,
                field=field,
                saturation_fix=saturation_fix,
            )

    def edge_attribution(
        self,
        loaded: LoadedModel,
        clean: Encoded,
        corrupted: Encoded,
        metric: edge_attribution.Metric,
        *,
        steps: int,
        field: str = "steps",
    ) -> edge_attribution.EdgePasses:
        """find_circuit's EAP-IG passes (one backward over ``steps`` rows), refused when the backward's activations
        would not fit the budget."""
        facts = loaded.facts
        senders = 1 + facts.num_layers * facts.num_heads
        receivers = 1 + facts.num_layers * (facts.num_heads + 2 * facts.num_kv_heads)
        scored = (senders + receivers) * corrupted.length * facts.hidden_size * 8  # float64 writes and gradients
        held = evidence.gradient_bytes(loaded, corrupted.length) * steps + scored
        what = f"edge attribution's backward over {corrupted.length} tokens × {steps} interpolation steps"
        of, advice = "activations and per-edge tensors", "use fewer steps or a shorter pair"
        self.check_budget(held, what, of=of, advice=advice, field=field)
        with guarded(loaded):
            return edge_attribution.edge_attribution(
                loaded, clean.input_ids, corrupted.input_ids, metric, steps=steps, field=field
            )

    def edge_patched_logits(
        self,
        loaded: LoadedModel,
        clean: Encoded,
        passes: edge_patching.EdgePasses,
        sets: Sequence[Sequence[tuple[int, int]]],
        nodes: Sequence[set[int]],
        *,
        readout: Readout,
    ) -> tuple[torch.Tensor, ...]:
        """What ``readout`` keeps of the clean prompt's last-position logits with only each set's edges clean (exact
        edge patching, :mod:`agent_tools.runner.edge_patching`); rows batched within the memory budget."""
        rows = patching.rows_per_batch(loaded, clean.length, self.memory_budget)
        with guarded(loaded):
            return edge_patching.edge_patched_logits(
                loaded, clean.input_ids, passes, sets, nodes, readout=readout, max_rows=rows
            )

    def embedding_attribution(
        self, loaded: LoadedModel, ids: list[int], answer: list[int], variants: Sequence[Sequence[int]]
    ) -> attribution_patching.SegmentEstimates:
        """The answer's log-probability change, to first order, when each same-length variant replaces the prompt."""
        self.check_gradient_budget(loaded, len(ids))
        with guarded(loaded):
            return attribution_patching.embedding_attribution(loaded, ids, answer, variants)
