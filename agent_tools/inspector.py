"""The inspector: the one place that resolves models, tokenises, validates requests and runs the model.

Every tool calls an :class:`Inspector`; every surface (CLI, LangChain, MCP, OpenAI-style dispatch) calls the
tools. Every forward pass goes through it (to :mod:`agent_tools.runner`, the only code that calls a model).
The inspector owns the session's policy: which models may be loaded, the token limit, the memory
budget for what a call will hold, and where artifact files may be written.
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from agent_tools import runner
from agent_tools.capture import AttentionConsumer, layer_checkpoints
from agent_tools.errors import CallCancelledError, DeadlineExceededError, InvalidInputError, ResourceLimitError
from agent_tools.intervene import AblationMethod
from agent_tools.loading import LoadedModel, ModelPolicy, load_model
from agent_tools.placement import Placement
from agent_tools.runner import attribution as evidence
from agent_tools.runner import attribution_patching, edge_attribution, edge_patching, patching, paths, replay
from agent_tools.runner.forward import locked
from agent_tools.schemas import AttentionPath, ChatMessage, Token
from agent_tools.settings import DEFAULT_MEMORY_BUDGET, readable_size
from agent_tools.usage import long_text_advice

if TYPE_CHECKING:
    from agent_tools.families import StackFacts

# Bytes of one layer's scores, logits and weights computed at once (query chunking): ~300 rows at 2k tokens.
# Smaller blocks stay in cache and let causal chunks skip more keys (benchmarks/: 64 MB beat 256 MB by 8%).
WORKING_SET_BUDGET = 64 * 1024**2
CHARS_PER_TOKEN_CEILING = 64  # a text longer than limit·64 characters cannot fit, whatever the tokenizer
MAX_NEW_TOKENS = 256
# Answer tokens an encoder–decoder's decoder reads when a per-layer tool looks at its decoder or cross stack.
DECODER_TOKENS = 16
# Items any one list argument may hold. Every list a tool takes is bounded by the model (layers, heads: the largest
# models have a few thousand heads) or by sense (messages, segments, temperatures); the cap keeps a hostile request
# of 100,000 items from costing seconds of validation before the model's own bound is checked.
MAX_LIST_ITEMS = 4096


@dataclass(frozen=True)
class DecoderInput:
    """The decoder side of an encoder–decoder pass: what the decoder reads, teacher-forced.

    ``input_ids`` (1, n) are the decoder start token and the model's greedy answer without its last token, so
    row i is the query that chose ``answer[i]`` (one row per answer token); ``tokens`` label those rows.
    """

    input_ids: torch.Tensor
    tokens: list[Token]
    answer: list[int]  # the answer ids, answer[i] chosen at row i
    stopped: str  # "eos" or "max_new_tokens"

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[-1])


@dataclass(frozen=True)
class Encoded:
    """A tokenised input: ids (1, T), mask (1, T), tokens with positions, and the text they index.

    ``stack`` is the attention stack a pass over it captures (None = the model's default); for an
    encoder–decoder's ``"decoder"`` and ``"cross"`` stacks ``decoder`` holds what the decoder reads. The rows of a
    captured map are :attr:`query_tokens`, its columns :attr:`key_tokens` (both ``tokens`` for self-attention).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    tokens: list[Token]
    offsets: list[tuple[int, int]]
    text: str
    stack: str | None = None
    decoder: DecoderInput | None = None

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[-1])

    def labels(self) -> list[str]:
        return [f"{t.position}:{t.text}" for t in self.tokens]

    @property
    def query_tokens(self) -> list[Token]:
        """The tokens of the captured map's rows: the decoder's for the decoder and cross stacks."""
        return self.decoder.tokens if self.decoder is not None else self.tokens

    @property
    def key_tokens(self) -> list[Token]:
        """The tokens of the captured map's columns: the decoder's for the decoder stack, else the input's."""
        return self.decoder.tokens if self.decoder is not None and self.stack == "decoder" else self.tokens

    def query_labels(self) -> list[str]:
        return [f"{t.position}:{t.text}" for t in self.query_tokens]

    def key_labels(self) -> list[str]:
        return [f"{t.position}:{t.text}" for t in self.key_tokens]

    def on_stack(self, stack: str | None, decoder: DecoderInput | None = None) -> Encoded:
        """The same input, captured on ``stack`` (with what the decoder reads, for the decoder and cross)."""
        return replace(self, stack=stack, decoder=decoder)


Result = TypeVar("Result")


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


def validate_text(text: str, *, field: str = "text") -> str:
    if not isinstance(text, str):
        raise InvalidInputError(f"{field} must be a string, got {type(text).__name__}", field=field)
    if not text.strip():
        raise InvalidInputError(f"{field} is empty or whitespace only; give at least one word", field=field)
    return check_unicode(text, field=field)


def check_unicode(text: str, *, field: str = "text") -> str:
    """Refuse strings that cannot be UTF-8 encoded (lone surrogates such as ``"\\ud800"`` from JSON escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        msg = (
            f"{field} holds characters that are not valid Unicode (e.g. lone surrogates at {exc.start}); "
            "send UTF-8 text"
        )
        raise InvalidInputError(msg, field=field) from exc
    return text


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
        if where:
            check_index(value, count, name, where=where)
        else:
            check_index(value, count, name)
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


@dataclass
class CallContext:
    """One tool call's stop conditions: a cancel flag its surface may set, and an optional time limit.

    A worker thread cannot be killed safely (it may hold the model's lock, half-way through a capture), so the
    runner checks the context instead — before every layer, between query chunks and generation steps, and while
    waiting for the lock — and :meth:`check` raises there. The exception unwinds every ``finally`` (capture
    configs, hooks, the lock): the next call finds the model free and unchanged. The surface creates the context,
    runs the tool inside :func:`call_scope` in the worker thread, and calls :meth:`cancel` from its own thread.
    """

    timeout: float | None = None  # seconds from ``started``; None = no limit
    started: float = field(default_factory=time.monotonic)
    reason: str = ""
    # Called from the worker with the elapsed seconds at the first check and then at most every
    # ``progress_every`` seconds: a server tells its client the call is alive (and how close to the limit).
    progress: Callable[[float], None] | None = None
    progress_every: float = 2.0
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _reported: float | None = field(default=None, repr=False)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def cancelled(self) -> bool:
        return self._stop.is_set()

    def cancel(self, reason: str = "the client cancelled it") -> None:
        """Ask the call to stop at its next checkpoint (thread-safe; the first reason is kept)."""
        if not self._stop.is_set():
            self.reason = reason
            self._stop.set()

    def check(self) -> None:
        """Raise :class:`CallCancelledError` once cancelled, :class:`DeadlineExceededError` once past the limit."""
        if self._stop.is_set():
            raise CallCancelledError(f"the call was stopped after {self.elapsed:.1f} s because {self.reason}")
        elapsed = self.elapsed
        if self.timeout is not None and elapsed > self.timeout:
            msg = (
                f"the call ran past this server's time limit of {self.timeout:g} s and was stopped; ask for less "
                "(fewer layers or heads, a shorter text), or ask the operator for a longer --call-timeout"
            )
            raise DeadlineExceededError(msg)
        if self.progress is not None and (self._reported is None or elapsed - self._reported >= self.progress_every):
            self._reported = elapsed
            self.progress(elapsed)


_CALL: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar("attention_explainer_call", default=None)


@contextmanager
def call_scope(context: CallContext) -> Iterator[CallContext]:
    """Run the block as the call ``context`` describes: every pass the inspector starts in it checks ``context``."""
    token = _CALL.set(context)
    try:
        yield context
    finally:
        _CALL.reset(token)


def current_call() -> CallContext | None:
    """The context of the call running in this thread (None outside :func:`call_scope`)."""
    return _CALL.get()


def _checkpoint() -> Callable[[], None] | None:
    context = _CALL.get()
    return None if context is None else context.check


def check_new_tokens(value: int) -> int:
    """``max_new_tokens`` in 1..MAX_NEW_TOKENS, or an error naming the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NEW_TOKENS:
        msg = f"max_new_tokens {value!r} out of range 1..{MAX_NEW_TOKENS}"
        raise InvalidInputError(msg, field="max_new_tokens")
    return value


def stack_where(loaded: LoadedModel, stack: StackFacts) -> str:
    """The end of a range error: ' of the decoder stack' on an encoder–decoder, nothing on a single-stack model."""
    return f" of the {stack.name} stack" if loaded.facts.is_encoder_decoder else ""


def kv_head_of(stack: StackFacts, head: int) -> int:
    """The KV head query head ``head`` of ``stack`` reads (transformers' ``repeat_kv`` layout)."""
    return head // max(1, stack.num_heads // stack.num_kv_heads)


def _token_text(tokenizer: Any, token_id: int, text: str, offset: tuple[int, int] | None) -> str:
    piece = tokenizer.decode([token_id])
    if "\ufffd" in piece and offset is not None and offset[1] > offset[0]:
        return text[offset[0] : offset[1]]
    return piece


class Inspector:
    """Session state shared by the tools: model policy and placement, limits, artifact folder.

    ``placement`` (dtype, device, device map, memory limits, offload, quantization) is the operator's, like the
    model allow-list: tools read models through :meth:`model`, which always loads with it.
    """

    def __init__(
        self,
        *,
        policy: ModelPolicy | None = None,
        token_limit: int | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        artifact_dir: str | Path | None = None,
        placement: Placement | None = None,
        allowed_data: Sequence[str | Path] = (),
    ) -> None:
        self.policy = policy or ModelPolicy()
        self.placement = (placement or Placement()).validate()  # the operator's choice; no tool argument changes it
        self._served: dict[str, LoadedModel] = {}  # name -> the model this session handed out under that name
        self.token_limit = token_limit
        self.memory_budget = memory_budget
        self.artifact_dir = Path(artifact_dir).resolve() if artifact_dir else None
        # data files (or corpus output folders) the operator allows tools to read; an agent only names one
        self.allowed_data: tuple[Path, ...] = tuple(Path(p).expanduser().resolve() for p in allowed_data)
        self.texts = TextStore()  # long texts the reports' next calls name by handle, for this session
        # the last input each model ran (reports state the path gap on it) and the gaps measured, per model + text
        self._last_input: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
        self._path_gaps: dict[tuple[str, str], paths.PathGap] = {}

    # --- models -------------------------------------------------------------------------------------
    def model(self, reference: str | None = None) -> LoadedModel:
        loaded = load_model(self.policy.check(reference), self.placement)
        self._served[loaded.name] = loaded
        return loaded

    def served(self, name: str) -> LoadedModel | None:
        """The model this session handed out as ``name`` (None if it never did): reports state its dtype/device."""
        return self._served.get(name)

    def limit_for(self, loaded: LoadedModel) -> int:
        limits = [v for v in (loaded.facts.max_positions, self.token_limit) if v]
        return min(limits) if limits else 4096

    def attention_path(self, name: str) -> AttentionPath | None:
        """The path reports on model ``name`` explain (eager) and, when the model's default differs, the gap
        between the two passes' outputs on the last text it ran: measured once per model and text (two forwards)."""
        loaded = self._served.get(name)
        if loaded is None:
            return None
        default = paths.default_implementation(loaded)
        path = AttentionPath(explained=paths.EXPLAINED_PATH, model_default=default)
        last = self._last_input.get(name)
        if default == paths.EXPLAINED_PATH or last is None:
            return path
        input_ids, mask, decoder = last
        parts = [input_ids] + [t for t in (mask, decoder) if t is not None]
        key = (name, hashlib.sha256(b"".join(t.cpu().numpy().tobytes() for t in parts)).hexdigest()[:16])
        gap = self._path_gaps.get(key)
        if gap is None:
            length = max(input_ids.shape[-1], decoder.shape[-1] if decoder is not None else 0)
            gap = paths.path_gap(
                loaded, input_ids, mask, decoder_input_ids=decoder, query_chunk=self.query_chunk(loaded, length),
                checkpoint=_checkpoint(),
            )  # fmt: skip
            if len(self._path_gaps) >= _PATH_GAPS_KEPT:
                self._path_gaps.pop(next(iter(self._path_gaps)))
            self._path_gaps[key] = gap
        return path.model_copy(update=_gap_fields(gap))

    def _ran(
        self, loaded: LoadedModel, input_ids: torch.Tensor, mask: torch.Tensor | None, decoder: torch.Tensor | None
    ) -> None:
        self._last_input[loaded.name] = (input_ids, mask, decoder)

    # --- tokenising ---------------------------------------------------------------------------------
    def render_messages(
        self, loaded: LoadedModel, messages: Sequence[ChatMessage | dict], *, add_generation_prompt: bool = True
    ) -> str:
        if not messages:
            raise InvalidInputError("messages is empty; give at least one {role, content} message", field="messages")
        parsed = [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in messages]
        for message in parsed:
            validate_text(message.content, field="messages.content")
        tokenizer = loaded.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidInputError(
                f"model {loaded.name!r} has no chat template; send plain text instead", field="messages"
            )
        try:
            rendered = tokenizer.apply_chat_template(
                [m.model_dump() for m in parsed], tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja raises TemplateError for roles a template does not accept
            raise InvalidInputError(f"the chat template refused these messages: {exc}", field="messages") from exc
        return str(rendered)  # tokenize=False gives the text

    def encode(self, loaded: LoadedModel, text: str, *, add_special_tokens: bool = True) -> Encoded:
        """Tokenise with offsets, enforcing the token limit (the model's positions or the session's)."""
        loaded.facts.require_text_input(loaded.name)  # Whisper & co. read audio features, not token ids
        validate_text(text)
        limit = self.limit_for(loaded)
        if len(text) > limit * CHARS_PER_TOKEN_CEILING:
            msg = f"text of {len(text):,} characters exceeds the token limit of {limit} tokens for {loaded.name!r}"
            raise ResourceLimitError(f"{msg}: {long_text_advice(limit)}", field="text")
        tokenizer = loaded.tokenizer
        encoding = tokenizer(
            text, return_offsets_mapping=True, add_special_tokens=add_special_tokens, return_tensors="pt"
        )
        ids = encoding["input_ids"][:, :]
        length = ids.shape[-1]
        if length == 0:
            raise InvalidInputError("text produced no tokens; give at least one word", field="text")
        if length > limit:
            msg = f"text is {length:,} tokens; {loaded.name!r} accepts at most {limit:,} tokens here"
            raise ResourceLimitError(f"{msg}: {long_text_advice(limit)}", field="text")
        offsets = [(int(start), int(end)) for start, end in encoding["offset_mapping"][0].tolist()]
        special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        tokens = [
            Token(
                position=i,
                text=_token_text(tokenizer, int(t), text, offsets[i]),
                token_id=int(t),
                special=int(t) in special_ids,
            )
            for i, t in enumerate(ids[0].tolist())
        ]
        mask = encoding.get("attention_mask", torch.ones_like(ids))
        return Encoded(input_ids=ids, attention_mask=mask, tokens=tokens, offsets=offsets, text=text)

    # --- validation -----------------------------------------------------------------------------------
    def check_layer(self, loaded: LoadedModel, layer: int, stack: StackFacts | None = None) -> int:
        """A layer index of ``stack`` (None = the default stack), or an error naming that stack's range."""
        if stack is None:
            return check_index(layer, loaded.facts.num_layers, "layer")
        return check_index(layer, stack.num_layers, "layer", where=stack_where(loaded, stack))

    def check_head(self, loaded: LoadedModel, head: int, stack: StackFacts | None = None) -> int:
        if stack is None:
            return check_index(head, loaded.facts.num_heads, "head")
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
        return encoded.on_stack(stack.name, self.decoder_input(loaded, encoded, max_new_tokens or DECODER_TOKENS))

    def decoder_input(self, loaded: LoadedModel, encoded: Encoded, max_new_tokens: int) -> DecoderInput:
        """The model's greedy answer to ``encoded`` as what its decoder reads: the start token + the answer
        without its last token (one row per answer token)."""
        if not loaded.facts.is_language_model:
            msg = (
                f"model {loaded.name!r} has no next-token head, so it cannot answer and its decoder has nothing to "
                "read; the decoder and cross stacks need an encoder–decoder with its language-model head (e.g. "
                "...ForConditionalGeneration): use attention='encoder'"
            )
            raise InvalidInputError(msg, field="attention")
        return self.answer_input(loaded, encoded, self.generate(loaded, encoded, max_new_tokens=max_new_tokens))

    def answer_input(self, loaded: LoadedModel, encoded: Encoded, generation: runner.Generation) -> DecoderInput:
        """What the decoder reads to reproduce ``generation`` teacher-forced: the start token + all but the last
        answer token."""
        start = runner.decoder_start_id(loaded)
        ids = [start, *generation.token_ids[:-1]]
        special = set(getattr(loaded.tokenizer, "all_special_ids", []) or [])
        tokens = [
            Token(position=i, text=str(loaded.tokenizer.decode([t])), token_id=t, special=t in special)
            for i, t in enumerate(ids)
        ]
        input_ids = torch.tensor([ids], dtype=encoded.input_ids.dtype)
        return DecoderInput(input_ids=input_ids, tokens=tokens, answer=generation.token_ids, stopped=generation.stopped)

    def check_budget(self, held_bytes: int, what: str) -> None:
        """Refuse, before the run, a call whose estimate of what it will hold (maps, copies) is over the budget.

        The budget applies per device: what a call keeps stays on the device of the layer that made it (one
        layer's maps for show/reconstruct, CPU-side grids for the report), so each estimate is for one device.
        """
        if held_bytes > self.memory_budget:
            msg = (
                f"{what} would hold about {readable_size(held_bytes)} of attention maps, over the budget of "
                f"{readable_size(self.memory_budget)}; ask for fewer layers/heads or a shorter text"
            )
            raise ResourceLimitError(msg)

    def query_chunk(self, loaded: LoadedModel, length: int) -> int | None:
        """Rows per chunk so that one layer's scores and weights stay within the working-set budget (``length``:
        the keys and rows of the pass, the longer side for an encoder–decoder)."""
        per_row = 3 * loaded.facts.num_heads * length * 4  # scores, logits, weights in float32
        rows = max(1, WORKING_SET_BUDGET // per_row)
        return None if rows >= length else int(rows)

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
            checkpoint=_checkpoint(),
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
            checkpoint=_checkpoint(),
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
            checkpoint=_checkpoint(),
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
                checkpoint=_checkpoint(),
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
            checkpoint=_checkpoint(),
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
        checkpoint = _checkpoint()
        with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
            return runner.ablated_forward(
                loaded, input_ids, attention_mask, heads, method=method, clean=clean, resample_ids=resample_ids
            )

    def head_outputs(self, loaded: LoadedModel, input_ids: torch.Tensor, layers: Sequence[int]) -> dict:
        """Layer -> (T, H, D) every head's output before W_O on a (1, T) input (see :func:`runner.head_outputs`)."""
        checkpoint = _checkpoint()
        with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
            return runner.head_outputs(loaded, input_ids, layers)

    def ablated_rows(
        self,
        loaded: LoadedModel,
        input_ids: torch.Tensor,
        rows: Sequence[runner.HeadSetAblation],
        *,
        replacements: dict,
        reduce: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """What ``reduce`` keeps of the clean output and of each head set's ablated output, the sets batched as
        rows (see :func:`agent_tools.runner.ablated_rows`)."""
        length = int(input_ids.shape[-1])
        max_rows = runner.ablation.rows_per_batch(loaded, length, self.memory_budget)
        checkpoint = _checkpoint()
        with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
            return runner.ablated_rows(
                loaded, input_ids, rows, replacements=replacements, reduce=reduce, max_rows=max_rows
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

    # --- data files ---------------------------------------------------------------------------------
    def data_file(self, name: str) -> Path:
        """The allowed data file (or corpus output folder) called ``name``: its file name, or its path as allowed.

        Only the operator's ``allowed_data`` can be read; ``name`` is compared as a string and never resolved, so
        no path an agent makes up (``../``, absolute paths, links) reaches the filesystem.
        """
        for path in self.allowed_data:
            if name in (path.name, str(path)):
                return path
        if not self.allowed_data:
            msg = "no data files are allowed in this session (the operator allows them with --allow-data PATH)"
        else:
            msg = f"data {name!r} is not allowed here; allowed: {', '.join(sorted(p.name for p in self.allowed_data))}"
        raise InvalidInputError(msg, field="data")

    # --- artifacts ------------------------------------------------------------------------------------
    def artifact_path(self, stem: str, suffix: str) -> Path:
        """A file inside the configured artifact folder; refused when the session has none."""
        if self.artifact_dir is None:
            msg = "artifact files are not enabled in this session (no artifact folder configured)"
            raise InvalidInputError(msg, field="png")
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-")[:80]
        try:
            self.artifact_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            msg = (
                f"the artifact folder {self.artifact_dir} cannot be created ({exc.strerror}); configure a writable one"
            )
            raise InvalidInputError(msg, field="png") from exc
        if not os.access(self.artifact_dir, os.W_OK):
            msg = f"the artifact folder {self.artifact_dir} is not writable; configure a writable one"
            raise InvalidInputError(msg, field="png")
        return self.artifact_dir / f"{safe}{suffix}"

    # --- evidence -------------------------------------------------------------------------------------
    # Causal and gradient checks beside attention (issue 16). Each method adds the call's checkpoint (cancel,
    # deadline) and delegates to agent_tools.runner.attribution / agent_tools.runner.patching.
    def segment_ablations(
        self,
        loaded: LoadedModel,
        prompt: list[int],
        answer: list[int],
        variants: Sequence[evidence.SegmentVariant],
        *,
        traced: evidence.TracedAnswer | None = None,
    ) -> evidence.AblationLogprobs:
        """The answer's log-probabilities clean and with each segment removed / replaced by neutral tokens
        (``traced``: the traced pass's logits and KV cache, so the clean prompt does not run again)."""
        checkpoint = _checkpoint()
        with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
            return evidence.segment_ablations(loaded, prompt, answer, variants, traced=traced)

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
            checkpoint=_checkpoint(),
        )

    def input_gradients(
        self, loaded: LoadedModel, ids: list[int], baseline: list[int], answer: list[int], *, steps: int
    ) -> evidence.InputGradients:
        """Integrated gradients and gradient × input, rows per forward chosen so activations fit the budget."""
        per_row = self.check_gradient_budget(loaded, len(ids))
        rows = max(1, min(steps, self.memory_budget // per_row))
        checkpoint = _checkpoint()
        with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
            return evidence.input_gradients(loaded, ids, baseline, answer, steps=steps, batch_rows=rows)

    def check_gradient_budget(self, loaded: LoadedModel, length: int) -> int:
        """The activations one row of a backward pass over ``length`` tokens holds, refused over the budget."""
        per_row = evidence.gradient_bytes(loaded, length)
        if per_row > self.memory_budget:
            msg = (
                f"a gradient pass over {length} tokens would hold about {readable_size(per_row)} of activations, "
                f"over the budget of {readable_size(self.memory_budget)}; use a shorter prompt or checks without "
                "'gradient'"
            )
            raise ResourceLimitError(msg, field="checks")
        return per_row

    def direct_logits(self, loaded: LoadedModel, encoded: Encoded, token: int) -> evidence.DirectLogits:
        """Every head's direct write into ``token``'s logit at the last position (final norm scale frozen)."""
        checkpoint = _checkpoint()
        with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
            return evidence.direct_logits(loaded, encoded.input_ids, token)

    def recorded_run(self, loaded: LoadedModel, encoded: Encoded, *, keep_last: bool = True) -> patching.RecordedRun:
        """A forward recording every head's output before W_O (what patching copies from a clean run)."""
        checkpoint = _checkpoint()
        with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
            return patching.recorded_run(loaded, encoded.input_ids, keep_last=keep_last)

    def patched_outputs(
        self,
        loaded: LoadedModel,
        encoded: Encoded,
        patches: Sequence[patching.HeadPatch],
        *,
        sources: dict[int, torch.Tensor] | None = None,
        keep_last: bool = True,
        prefix: int = 0,
    ) -> torch.Tensor:
        """(R, K, V) outputs of R patched variants of one input, batched (see :mod:`agent_tools.runner.patching`)."""
        rows = min(patching.rows_per_batch(loaded, encoded.length, self.memory_budget), patching.BATCH_ROWS)
        checkpoint = _checkpoint()
        with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
            return patching.patched_outputs(
                loaded, encoded.input_ids, patches, sources=sources, keep_last=keep_last, max_rows=rows, prefix=prefix
            )

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
        if held > self.memory_budget:
            msg = (
                f"attribution patching's backward over {corrupted.length} tokens × {rows} rows would hold about "
                f"{readable_size(held)} of activations, over the budget of {readable_size(self.memory_budget)}; use "
                "method 'exact', a shorter pair" + (" or grad_drop false" if grad_drop else "")
            )
            raise ResourceLimitError(msg, field=field)
        checkpoint = _checkpoint()
        with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
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
        if held > self.memory_budget:
            msg = (
                f"edge attribution's backward over {corrupted.length} tokens × {steps} interpolation steps would hold "
                f"about {readable_size(held)} of activations and per-edge tensors, over the budget of "
                f"{readable_size(self.memory_budget)}; "
                "use fewer steps or a shorter pair"
            )
            raise ResourceLimitError(msg, field=field)
        checkpoint = _checkpoint()
        with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
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
    ) -> torch.Tensor:
        """(R, V) last-position logits of the clean prompt with only each set's edges clean (exact edge patching,
        :mod:`agent_tools.runner.edge_patching`); rows batched within the memory budget."""
        rows = min(patching.rows_per_batch(loaded, clean.length, self.memory_budget), patching.BATCH_ROWS)
        checkpoint = _checkpoint()
        with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
            return edge_patching.edge_patched_logits(loaded, clean.input_ids, passes, sets, nodes, max_rows=rows)

    def mlp_patched_logits(
        self, loaded: LoadedModel, encoded: Encoded, sources: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        """(R, V) last-position logits with one layer's MLP output replaced per row (layer -> (T, C) source)."""
        checkpoint = _checkpoint()
        with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
            return attribution_patching.mlp_patched_logits(loaded, encoded.input_ids, sources)

    def embedding_attribution(
        self, loaded: LoadedModel, ids: list[int], answer: list[int], variants: Sequence[Sequence[int]]
    ) -> attribution_patching.SegmentEstimates:
        """The answer's log-probability change, to first order, when each same-length variant replaces the prompt."""
        self.check_gradient_budget(loaded, len(ids))
        checkpoint = _checkpoint()
        with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
            return attribution_patching.embedding_attribution(loaded, ids, answer, variants)


TEXT_HANDLE_PREFIX = "@text:"
_TEXT_HANDLE = re.compile(r"@text:([0-9a-f]{16})")
HANDLE_AFTER_CHARS = 160  # a string argument of a next call longer than this is named by handle
TEXTS_KEPT = 512  # texts a session keeps in memory for its handles (the oldest are forgotten first)


class TextStore:
    """The long texts a session's follow-up calls refer to by handle (``"@text:<16 hex digits>"``).

    A report's ``next_calls`` would otherwise repeat an 8,000-token text (35 KB) in every suggested call: each
    string argument over :data:`HANDLE_AFTER_CHARS` characters becomes a handle (:meth:`refer`), and the tools
    accept a handle wherever they take that string (:meth:`resolve`), for the rest of the session. With a
    ``folder`` (the command line's cache folder) the texts are also kept as files, so the next process reads
    them. A handle is a digest of the text: it names only a text this session (or that folder) was given.
    """

    def __init__(self, folder: Path | None = None, *, capacity: int = TEXTS_KEPT) -> None:
        self.folder = folder
        self.capacity = capacity
        self._texts: dict[str, str] = {}
        self._lock = threading.Lock()

    def handle(self, text: str) -> str:
        """The handle of ``text``, which this store will resolve (kept in memory, and in the folder if any)."""
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        with self._lock:
            self._texts.pop(digest, None)
            self._texts[digest] = text  # most recent last
            while len(self._texts) > self.capacity:
                self._texts.pop(next(iter(self._texts)))
        if self.folder is not None:
            path = self.folder / f"{digest}.txt"
            try:
                if not path.exists():
                    self.folder.mkdir(parents=True, exist_ok=True)
                    partial = path.with_name(f".{digest}.{os.getpid()}.partial")
                    partial.write_text(text, encoding="utf-8", errors="surrogatepass")
                    os.replace(partial, path)
            except OSError:
                pass  # the handle still works in this process
        return TEXT_HANDLE_PREFIX + digest

    def text(self, handle: str, *, field: str | None = None) -> str:
        """The text a handle names; an unknown handle is an input error that says what to send instead."""
        match = _TEXT_HANDLE.fullmatch(handle)
        digest = match.group(1) if match else ""
        with self._lock:
            known = self._texts.get(digest)
        if known is None and digest and self.folder is not None:
            try:
                known = (self.folder / f"{digest}.txt").read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                known = None
        if known is None:
            msg = (
                f"{field or 'argument'}: text handle {handle!r} names no text this session has seen (handles "
                "last for the session that wrote them); send the text itself"
            )
            raise InvalidInputError(msg, field=field)
        return known

    def resolve(self, arguments: Any, _field: str | None = None) -> Any:
        """``arguments`` with every handle (at any depth) replaced by its text; the same object if none."""
        if isinstance(arguments, str):
            return self.text(arguments, field=_field) if arguments.startswith(TEXT_HANDLE_PREFIX) else arguments
        if isinstance(arguments, dict):
            items = {k: self.resolve(v, _field or str(k)) for k, v in arguments.items()}
            return arguments if all(items[k] is arguments[k] for k in arguments) else items
        if isinstance(arguments, list):
            values = [self.resolve(v, _field) for v in arguments]
            return arguments if all(a is b for a, b in zip(values, arguments, strict=True)) else values
        return arguments

    def refer(self, arguments: Any, *, after: int = HANDLE_AFTER_CHARS) -> Any:
        """``arguments`` with every string longer than ``after`` characters replaced by its handle."""
        if isinstance(arguments, str):
            return self.handle(arguments) if len(arguments) > after else arguments
        if isinstance(arguments, dict):
            return {k: self.refer(v, after=after) for k, v in arguments.items()}
        if isinstance(arguments, list):
            return [self.refer(v, after=after) for v in arguments]
        return arguments


_PATH_GAPS_KEPT = 16  # (model, text) path gaps kept per session


def _gap_fields(gap: paths.PathGap) -> dict[str, Any]:
    """The gap's numbers for :class:`AttentionPath`, at three significant digits (KL can be 1e-12)."""

    def short(value: float | None) -> float | None:
        return None if value is None else float(f"{value:.3g}")

    return {
        "tokens": gap.tokens,
        "max_output_difference": short(gap.max_output_difference),
        "mean_kl": short(gap.mean_kl),
        "max_kl": short(gap.max_kl),
        "top1_agreement": short(gap.top1_agreement),
    }


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:10]
