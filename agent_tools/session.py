"""The session: what every call of one inspector shares and the operator alone sets.

The model policy (which models may load) and placement, the per-session model cache, the token limit, the memory
budget a call may hold (and the query chunk it implies), the data files tools may read, the artifact folder, the
long texts next calls name by handle, and the gap between the explained and the model's default attention path.
Beside it, the call being run: :class:`CallContext` (cancel flag, deadline) and :func:`guarded`, the model's lock
with the call's checkpoint before every layer, under which any :mod:`agent_tools.runner` function may run.
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent_tools.capture import layer_checkpoints
from agent_tools.errors import (
    CallCancelledError,
    DeadlineExceededError,
    InvalidInputError,
    ResourceLimitError,
    UnsupportedModelError,
)
from agent_tools.files import write_atomic
from agent_tools.loading import LoadedModel, ModelPolicy, load_model
from agent_tools.placement import Placement, attention_block_bytes, query_chunk_rows
from agent_tools.runner import attribution, paths
from agent_tools.runner.forward import locked
from agent_tools.schemas import AttentionPath
from agent_tools.settings import DEFAULT_MEMORY_BUDGET, readable_size


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
    # the last input each model ran in this call: a report's attention-path gap is measured on the call's own text,
    # never on another client's call that ran in between (the session's inspector is shared)
    inputs: dict[str, tuple[Any, Any, Any]] = field(default_factory=dict, repr=False)
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


def call_checkpoint() -> Callable[[], None] | None:
    """What a pass calls to check the current call (None outside :func:`call_scope`)."""
    context = _CALL.get()
    return None if context is None else context.check


@contextmanager
def guarded(loaded: LoadedModel) -> Iterator[None]:
    """Hold ``loaded``'s lock (waiting for it as the call allows) with the call's checkpoint before every layer:
    the block may run any :mod:`agent_tools.runner` pass on the model's own attention."""
    checkpoint = call_checkpoint()
    with locked(loaded, checkpoint), layer_checkpoints(loaded.model, checkpoint):
        yield


class Session:
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
        # the last input each model ran outside a call scope (inside one, the call keeps its own: CallContext.inputs;
        # reports state the path gap on it) and the gaps measured, per model + text
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

    def float16_overflow(self) -> UnsupportedModelError | None:
        """Why the current call failed when float16's range is the cause: a float16 model it ran whose own forward
        on that input is not finite (None otherwise: then the failure is a bug). Loads nothing: only the models
        the call ran, on their recorded inputs."""
        for name, last in self._inputs().items():
            loaded = self._served.get(name)
            if loaded is None or loaded.dtype != torch.float16 or paths.own_output_finite(loaded, *last):
                continue
            msg = (
                f"model {loaded.name!r} overflows float16 on this input: its own forward gives non-finite outputs "
                "(float16 holds magnitudes up to 65,504), so no number about it would mean anything; the operator "
                "can load it in bfloat16 (float32's range) or float32 (--dtype)"
            )
            return UnsupportedModelError(msg, field="model")
        return None

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
        last = self._inputs().get(name)
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
                checkpoint=call_checkpoint(),
            )  # fmt: skip
            if len(self._path_gaps) >= _PATH_GAPS_KEPT:
                self._path_gaps.pop(next(iter(self._path_gaps)))
            self._path_gaps[key] = gap
        return path.model_copy(update=_gap_fields(gap))

    def _ran(
        self, loaded: LoadedModel, input_ids: torch.Tensor, mask: torch.Tensor | None, decoder: torch.Tensor | None
    ) -> None:
        self._inputs()[loaded.name] = (input_ids, mask, decoder)

    def _inputs(self) -> dict[str, tuple[Any, Any, Any]]:
        """Model name -> the last input it ran: the current call's, or outside a call scope the session's."""
        context = current_call()
        return context.inputs if context is not None else self._last_input

    # --- budgets -------------------------------------------------------------------------------------
    def check_budget(
        self,
        held_bytes: int,
        what: str,
        *,
        of: str = "attention maps",
        advice: str = "ask for fewer layers/heads or a shorter text",
        field: str | None = None,
    ) -> None:
        """Refuse, before the run, a call whose estimate of what it will hold (maps, copies, activations ``of``)
        is over the budget, saying what would fit (``advice``).

        The budget applies per device: what a call keeps stays on the device of the layer that made it (one
        layer's maps for show/reconstruct, CPU-side grids for the report), so each estimate is for one device.
        """
        if held_bytes > self.memory_budget:
            size, budget = readable_size(held_bytes), readable_size(self.memory_budget)
            raise ResourceLimitError(
                f"{what} would hold about {size} of {of}, over the budget of {budget}; {advice}", field=field
            )

    def query_chunk(self, loaded: LoadedModel, length: int) -> int | None:
        """Rows per chunk so that one layer's scores and weights stay within the working set of the model's device
        (``length``: the keys and rows of the pass, the longer side for an encoder–decoder): 64 MiB on the CPU, a
        share of the free memory on CUDA (:func:`agent_tools.placement.attention_block_bytes`)."""
        return query_chunk_rows(loaded.facts.num_heads, length, attention_block_bytes(loaded.device))

    def check_gradient_budget(self, loaded: LoadedModel, length: int) -> int:
        """The activations one row of a backward pass over ``length`` tokens holds, refused over the budget."""
        per_row = attribution.gradient_bytes(loaded, length)
        advice = "use a shorter prompt or checks without 'gradient'"
        self.check_budget(
            per_row, f"a gradient pass over {length} tokens", of="activations", advice=advice, field="checks"
        )
        return per_row

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
                    write_atomic(path, text.encode("utf-8", "surrogatepass"))
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
    numbers = {name: getattr(gap, name) for name in ("max_output_difference", "mean_kl", "max_kl", "top1_agreement")}
    return {"tokens": gap.tokens} | {k: None if v is None else float(f"{v:.3g}") for k, v in numbers.items()}


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:10]
