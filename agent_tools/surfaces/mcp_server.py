"""MCP surface: every declared tool as an MCP tool with an input schema, an output schema and structured content.

Built on the official SDK's (2.x) low-level ``Server`` because the tools are generated from their declarations
(pydantic input and output models), not written as decorated functions. The SDK serves both protocol eras on
one connection: the ``initialize`` handshake (2024-11-05 .. 2025-11-25) and the 2026-07-28 per-request envelope
(``server/discover``); the client's first request decides. The session's policy is fixed when the server is
built (by the ``attention-explainer mcp`` options): which models may be loaded (an allow-list, exposed to
clients as an enum), the artifact folder and the token limit. Nothing an agent sends can widen them. The
default model starts loading in the server's lifespan, in the background: ``initialize`` and ``tools/list`` are
answered at once, and a tool call that arrives before the model is loaded waits for it (over HTTP: the load
starts when the server starts, once for every session). Over stdio the ``mcp`` command answers even before this
module (the SDK) is imported: :mod:`agent_tools.mcp_front` answers ``initialize``, ``ping`` and ``tools/list``
as this server would, then hands the session to it (:func:`serve_stdio`'s ``stdin`` and ``drop_answer_to``).

Results: ``structuredContent`` is the tool's report (``output_model.model_dump(mode="json")``, valid against the
advertised ``outputSchema``); the text content is the concise text an LLM reads (``--text-content json|both``
adds the report's JSON for clients that only read text). Expected failures come back as tool errors
(``isError``) whose text names what is valid; a bug is logged with its traceback and reported as an internal
error. Schemas are sized for an agent's context: input schemas have no ``$ref``; output schemas keep the
types and structure of the report and drop what only a reader needs (titles, descriptions, defaults).

The explanation templates are offered as MCP prompts, the full system prompt as the ``attention_explainer``
prompt, and a short version of it (``prompts/mcp_instructions.md``) as the server's instructions.

Reliability: a call runs in a worker thread under a :class:`~agent_tools.session.CallContext`. A client's
``notifications/cancelled`` (or the operator's ``call_timeout``) stops the pass at its next checkpoint — between
layers, query chunks and generation steps — which releases the model's lock; the server keeps serving. A call
whose request carries a ``progressToken`` gets progress notifications while it runs. On stdio, every line gets
the JSON-RPC answer it deserves: -32700 for what is not JSON (or not UTF-8), -32600 for what is not a request
(a batch, no ``"jsonrpc": "2.0"``, an object as id, ``params`` a string, deep nesting), -32601 for an unknown
method. Over HTTP the number of sessions and their idle time are capped.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import logging
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from functools import cache, partial
from typing import TYPE_CHECKING, Any, Literal, get_args

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp import types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from agent_tools import __version__
from agent_tools.errors import AttentionToolError, CallCancelledError, DeadlineExceededError, InvalidInputError
from agent_tools.files import os_error_message
from agent_tools.mcp_front import (
    MAX_LINE_BYTES,
    SERVER_NAME,
    RpcProblem,
    exit_flushed,
    read_message,
    server_instructions,
    tool_listing,
    valid_id,
)
from agent_tools.policy import ModelPolicy
from agent_tools.prompts import TOPICS, Topic, explanation_template, system_prompt, topic_file
from agent_tools.surfaces import concise_text, error_text, heap
from agent_tools.tool_declarations import served_names

if TYPE_CHECKING:  # the inspector and the tools import torch: they load in the background (see Backend)
    from langchain_core.prompts import ChatPromptTemplate

    from agent_tools.inspector import CallContext, Inspector
    from agent_tools.tools.registry import ToolSpec

logger = logging.getLogger(__name__)

TextContentMode = Literal["summary", "json", "both"]
TEXT_CONTENT_MODES: tuple[str, ...] = get_args(TextContentMode)
DEFAULT_TEXT_CONTENT: TextContentMode = "summary"
SYSTEM_PROMPT_NAME = "attention_explainer"
# Arguments that stood for a string that is valid JSON but not valid Unicode (a lone surrogate escape such as
# "\\ud800"): the SDK cannot parse such a line and would leave the request unanswered, so the stdio reader
# swaps the arguments for this marker and the tool answers with an error naming the argument.
INVALID_UNICODE_ARGUMENT = "_invalid_unicode"
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Past the call timeout, the handler answers after this grace even if the worker has not reached a checkpoint
# (a non-capturing stretch of a tool); the worker still stops at its next one.
STOP_GRACE_SECONDS = 5.0
PROGRESS_EVERY_SECONDS = 2.0
WAIT_POLL_SECONDS = 0.25  # a call waiting for the backend looks this often whether the server is ending
DEFAULT_MAX_SESSIONS = 64  # HTTP sessions open at once; the SDK's 10,000 idle sessions held +88 MB per 2,000
DEFAULT_SESSION_IDLE_SECONDS = 600.0  # an HTTP session with no request for this long is closed (SDK: 30 min)
# The SDK's loggers that say something per request or per session at INFO; the server keeps their warnings.
CHATTY_SDK_LOGGERS = ("mcp", "httpx", "httpx2", "uvicorn.access")
# The request model of every method a client may call in any protocol era this SDK serves (others get -32601): the
# handshake era's methods and the 2026-07-28 ones (``server/discover``).
REQUEST_TYPES = types.methods.MONOLITH_REQUESTS


def _text_blocks(report_text: str, structured: dict[str, Any], mode: TextContentMode) -> list[types.TextContent]:
    blocks = []
    if mode in ("summary", "both"):
        blocks.append(types.TextContent(type="text", text=report_text))
    if mode in ("json", "both"):
        blocks.append(types.TextContent(type="text", text=json.dumps(structured, ensure_ascii=False)))
    return blocks


def _error_result(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)


def build_server(
    inspector: Inspector | None = None,
    *,
    make_inspector: Callable[[], Inspector] | None = None,
    policy: ModelPolicy | None = None,
    tools: Iterable[str] | None = None,
    text_content: TextContentMode = DEFAULT_TEXT_CONTENT,
    preload: bool = True,
    call_timeout: float | None = None,
) -> Server[dict[str, Any]]:
    """An MCP server serving the declared tools (or the named subset) through one inspector.

    Building it imports neither torch nor a tool: ``tools/list`` and the prompts come from the tools' declaration
    data (:mod:`agent_tools.tool_declarations`), and the tools, the inspector and the default model load in a
    background thread (:class:`Backend`) that the server's lifespan starts (``preload``) or the first tool call
    does. A call that arrives before they are ready waits for them.

    Args:
        inspector: the session: its policy is the allow-list of models, its folder the only place files go.
            Or ``make_inspector`` and ``policy``: a function building it in the background (it imports torch)
            and the allow-list it will have, which ``tools/list`` states before it exists.
        tools: names of the tools to serve; all declared tools when omitted.
        text_content: what the text content holds beside the structured content: the concise text (the
            default, at most about 2 KB), the JSON of the report, or both (for clients that ignore structured
            content and want every number as text).
        preload: start importing the tools and loading the session's default model when the server starts (not
            at the first call).
        call_timeout: seconds a tool call may run; past it the call is stopped and answered with a
            ``deadline_exceeded`` tool error (None: no limit; the ``mcp`` command defaults to 120 s).
    """
    if text_content not in TEXT_CONTENT_MODES:
        raise InvalidInputError(f"text_content must be one of {TEXT_CONTENT_MODES}, got {text_content!r}")
    if call_timeout is not None and not call_timeout > 0:
        raise InvalidInputError(f"call_timeout must be a positive number of seconds, got {call_timeout!r}")
    if inspector is not None:
        given = inspector
        policy, make_inspector = inspector.policy, lambda: given
    if make_inspector is None or policy is None:
        raise TypeError("build_server needs an inspector, or make_inspector and its policy")
    names = served_names(tools)
    backend = Backend(make_inspector, names, preload=preload)
    tool_handlers = _tool_handlers(backend, policy, text_content, call_timeout)
    prompt_handlers = _prompt_handlers(names, policy)
    return Server(
        SERVER_NAME,
        version=__version__,
        instructions=server_instructions(names, policy),
        lifespan=_lifespan(backend),
        on_list_tools=tool_handlers[0],
        on_call_tool=tool_handlers[1],
        on_list_prompts=prompt_handlers[0],
        on_get_prompt=prompt_handlers[1],
    )


def _lifespan(backend: Backend) -> Callable[[Server[dict[str, Any]]], AbstractAsyncContextManager[dict[str, Any]]]:
    """The server's lifespan: start the backend (when it preloads) in the background.

    The server answers ``initialize``, ``tools/list`` and ``prompts/*`` at once while the tools import and the
    model loads (clients give up on ``initialize`` after 10 to 60 s; a load under load took 30 s); a tool call
    that arrives first waits for them (:meth:`Backend.wait`), with progress notifications when it asked for them.
    """

    @asynccontextmanager
    async def lifespan(_server: Server[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        if backend.preload:
            backend.start()
        yield {}  # the handlers hold the backend themselves

    return lifespan


class Backend:
    """The server's tools and inspector, imported and built in a daemon thread (torch and transformers take
    seconds to import; a server closed meanwhile does not wait), then the default model when ``preload``.

    ``start`` is idempotent: the lifespan calls it when the server preloads, the first tool call otherwise. A
    session that cannot be built (a placement the machine refuses) is logged in one line; each call then answers
    with that error. A default model that does not load does not end the server either: each call that needs it
    gets the same message as its error.
    """

    def __init__(self, make_inspector: Callable[[], Inspector], names: list[str], *, preload: bool) -> None:
        self.make_inspector = make_inspector
        self.names = names
        self.preload = preload
        self.ready = threading.Event()  # set when the tools and the inspector exist (or failed) and the load ended
        self.started = 0.0
        self.inspector: Inspector | None = None
        self.specs: dict[str, ToolSpec] = {}
        self.error: AttentionToolError | None = None
        self._start_lock = threading.Lock()

    def start(self) -> None:
        with self._start_lock:
            if self.started:
                return
            self.started = time.monotonic()
        threading.Thread(target=self._prepare, name="import-tools-and-load-model", daemon=True).start()

    def _prepare(self) -> None:
        try:
            inspector = self.make_inspector()
            from agent_tools.tools import TOOLS

            self.specs = {name: TOOLS[name] for name in self.names}
            self.inspector = inspector
            logger.info("tools ready in %.1f s", time.monotonic() - self.started)
            if self.preload:
                self._load_default(inspector)
        except AttentionToolError as exc:  # the session cannot be built here: every call says why
            logger.error("the tools cannot serve: %s", " ".join(exc.message.splitlines()))
            self.error = exc
        except Exception:  # a bug: logged; each call then reports an internal error
            logger.exception("preparing the tools failed")
        finally:
            self.ready.set()

    @staticmethod
    def _load_default(inspector: Inspector) -> None:
        try:
            loaded = inspector.model(None)
        except AttentionToolError as exc:
            # A model that cannot load (a cache that cannot be rebuilt, a missing package) must not end the
            # server: say it in one line; each call that needs the model then gets the same message as its error.
            logger.error("the default model did not load: %s", " ".join(exc.message.splitlines()))
        except Exception:  # a bug: logged; the calls that need the model raise it again themselves
            logger.exception("loading the default model failed")
        else:
            logger.info("loaded %s in %.1f s", loaded.name, loaded.load_seconds)

    async def wait(self, ctx: RequestContext) -> None:
        """Before a call runs: start the backend if nobody has, and wait for it, sending a progress notification
        every ``PROGRESS_EVERY_SECONDS`` (the SDK sends them to a request that asked for them: ``_meta.progressToken``).

        A server ending meanwhile (:func:`stop_running_calls`: stdin closed, Ctrl-C) stops the wait with
        :class:`CallCancelledError`, so the call is answered before the process ends."""
        self.start()
        waiting = _Waiting()
        with _running(waiting):
            await self._wait(ctx, waiting)

    async def _wait(self, ctx: RequestContext, waiting: _Waiting) -> None:
        next_progress = time.monotonic() + PROGRESS_EVERY_SECONDS
        while not await anyio.to_thread.run_sync(self.ready.wait, WAIT_POLL_SECONDS, abandon_on_cancel=True):
            if waiting.reason is not None:
                raise CallCancelledError(f"the call was stopped before it started: {waiting.reason}")
            if time.monotonic() < next_progress:
                continue
            next_progress += PROGRESS_EVERY_SECONDS
            waited = time.monotonic() - self.started
            message = f"loading the tools and the model ({waited:.0f} s); the call starts when they are ready"
            try:
                await ctx.session.report_progress(round(waited, 2), None, message)
            except Exception:  # the client went away: progress is best effort
                logger.debug("progress notification not sent", exc_info=True)


RequestContext = ServerRequestContext[dict[str, Any], Any]


def _tool_handlers(
    backend: Backend, policy: ModelPolicy, text_content: TextContentMode, call_timeout: float | None = None
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``tools/list`` and ``tools/call``: each tool runs in a worker thread; expected failures are tool errors."""
    listing = types.ListToolsResult.model_validate(tool_listing(backend.names, policy))

    async def list_tools(_ctx: RequestContext, _params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return listing

    async def call_tool(ctx: RequestContext, params: types.CallToolRequestParams) -> types.CallToolResult:
        name, arguments = params.name, params.arguments or {}
        if name not in backend.names:
            return _error_result(f"Error [invalid_input]: unknown tool {name!r}; tools: {', '.join(backend.names)}")
        try:
            _refuse_invalid_unicode(arguments)
            await backend.wait(ctx)  # the tools and the default model may still be loading in the background
            if backend.error is not None:  # the session could not be built: every call says why
                return _error_result(error_text(name, backend.error))
            if backend.inspector is None:
                return _error_result(f"Internal error in {name}: the tools could not be imported; see the server's log")
            from agent_tools.inspector import CallContext, check_list_lengths

            check_list_lengths(arguments)
            context = CallContext(timeout=call_timeout, progress_every=PROGRESS_EVERY_SECONDS)
            context.progress = _progress_reporter(ctx, context)
            report = await _run_call(backend.specs[name], backend.inspector, arguments, context)
        except CallCancelledError as exc:
            return _error_result(stopped_text(name, exc))
        except AttentionToolError as exc:
            return _error_result(error_text(name, exc))
        except OSError as exc:  # the server's machine refused (a full disk, a permission): not the arguments, no bug
            logger.warning("tool %s: %s", name, os_error_message(exc))
            return _error_result(system_error_text(name, exc))
        except Exception as exc:  # a bug: keep serving, log the traceback, tell the client plainly
            logger.exception("tool %s failed on %r", name, arguments)
            return _error_result(f"Internal error in {name}: {type(exc).__name__}: {exc}")
        structured = report.model_dump(mode="json")
        blocks = _text_blocks(concise_text(report), structured, text_content)
        return types.CallToolResult(content=list(blocks), structured_content=structured)

    return list_tools, call_tool


async def _run_call(spec: ToolSpec, inspector: Inspector, arguments: dict[str, Any], context: CallContext) -> Any:
    """Run one tool call in a worker thread under ``context``; return its report.

    Why ``abandon_on_cancel``: when the client cancels, the SDK cancels this handler (and, as the protocol
    says, sends no answer for the request). The handler gives up at once and cancels ``context``; the thread
    stops at its next checkpoint and releases the model's lock. Past the call timeout (plus a short grace for
    stretches without a checkpoint) the handler answers with a ``deadline_exceeded`` tool error the same way.
    """
    work = partial(_call_in_scope, spec, inspector, arguments, context)
    limit = None if context.timeout is None else context.timeout + STOP_GRACE_SECONDS
    try:
        with _running(context), anyio.move_on_after(limit) as scope:
            return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        context.cancel("the client cancelled it")
        raise
    assert scope.cancelled_caught
    context.cancel("it ran past the time limit")
    msg = f"the call ran past this server's time limit of {context.timeout:g} s and was stopped; ask for less"
    raise DeadlineExceededError(msg)


# The calls whose handler is waiting for their worker thread: a server ending (stdin closed, Ctrl-C) stops them all.
_RUNNING: dict[int, CallContext | _Waiting] = {}  # keyed by id(): a context is a dataclass, compared by value
_RUNNING_LOCK = threading.Lock()


class _Waiting:
    """A call waiting for the backend (no :class:`CallContext` yet: that needs the inspector's module, torch)."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def cancel(self, reason: str) -> None:
        self.reason = reason


@contextmanager
def _running(call: CallContext | _Waiting) -> Iterator[None]:
    """Hold ``call`` in :data:`_RUNNING` for the block."""
    with _RUNNING_LOCK:
        _RUNNING[id(call)] = call
    try:
        yield
    finally:
        with _RUNNING_LOCK:
            _RUNNING.pop(id(call), None)


def stop_running_calls(reason: str) -> int:
    """Cancel every call in flight (each worker stops at its next checkpoint); return how many there were."""
    with _RUNNING_LOCK:
        running = list(_RUNNING.values())
    for context in running:
        context.cancel(reason)
    return len(running)


def _call_in_scope(spec: ToolSpec, inspector: Inspector, arguments: dict[str, Any], context: CallContext) -> Any:
    """The worker thread's part: the tool under ``context`` (its passes check it); a stop is logged in one line."""
    from agent_tools.inspector import call_scope

    with call_scope(context):
        try:
            return spec(inspector, arguments)
        except CallCancelledError as exc:
            logger.info("%s stopped after %.1f s (%s)", spec.name, context.elapsed, exc.kind)
            raise
        finally:
            heap.release()  # the call's freed pages go back: RSS follows the calls in flight, not their peak


def _progress_reporter(ctx: RequestContext, context: CallContext) -> Callable[[float], None]:
    """Progress notifications, sent from the worker (the SDK sends them to a request that asked for them:
    ``_meta.progressToken``).

    They say the call is alive and how far it is toward the time limit (``total``), so a client that resets its
    own timeout on progress does not give up on a long call. The first is sent at the call's first checkpoint
    (the work is under way), then at most every ``PROGRESS_EVERY_SECONDS``.
    """
    session = ctx.session

    def report(elapsed: float) -> None:
        if context.cancelled:
            return
        message = f"running for {elapsed:.0f} s"
        try:
            anyio.from_thread.run(partial(session.report_progress, round(elapsed, 2), context.timeout, message))
        except Exception:  # the client went away, or the loop is closing: progress is best effort
            logger.debug("progress notification not sent", exc_info=True)

    return report


def system_error_text(tool: str, error: OSError) -> str:
    """The tool error of a call the server's machine refused: the path, what the system said, what to do."""
    return (
        f"Error [resource_limit]: {os_error_message(error)}. This is on the server's machine, not in the arguments: "
        f"tell its operator, or call {tool} without asking for a file."
    )


def stopped_text(tool: str, error: CallCancelledError) -> str:
    """The tool error of a call stopped before it finished: why, and what to do (not "fix the arguments")."""
    return f"Error [{error.kind}]: {error.message.rstrip('.')}. Nothing was computed; {tool} can be called again."


def _prompt_handlers(tool_names: list[str], policy: ModelPolicy) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``prompts/list`` and ``prompts/get``: the system prompt and one explanation template per topic,
    mentioning only the tools served. Built at the first prompts request (LangChain's templates take a moment
    to import: ``initialize`` does not wait for them)."""

    @cache
    def templates() -> dict[str, tuple[Topic, ChatPromptTemplate]]:
        return {f"explain_{topic}": (topic, explanation_template(topic, tools=tool_names)) for topic in TOPICS}

    @cache
    def prompts() -> dict[str, types.Prompt]:
        system = types.Prompt(
            name=SYSTEM_PROMPT_NAME,
            title="Attention explainer (system prompt)",
            description="How to use these tools and how to reason about attention: the tool catalogue and rules.",
            arguments=[],
        )
        explain = {
            name: types.Prompt(
                name=name,
                title=f"Explain {topic.replace('_', ' ')}",
                description=topic_file(topic).description,
                arguments=[types.PromptArgument(name=v, required=True) for v in template.input_variables],
            )
            for name, (topic, template) in templates().items()
        }
        return {SYSTEM_PROMPT_NAME: system, **explain}

    @cache
    def system_text() -> str:
        return system_prompt(tools=tool_names, policy=policy)

    async def list_prompts(_ctx: RequestContext, _params: types.PaginatedRequestParams | None) -> Any:
        return types.ListPromptsResult(prompts=list(prompts().values()))

    async def get_prompt(_ctx: RequestContext, params: types.GetPromptRequestParams) -> types.GetPromptResult:
        name = params.name
        if name not in prompts():
            raise MCPError(types.INVALID_PARAMS, f"unknown prompt {name!r}; prompts: {', '.join(prompts())}")
        if name == SYSTEM_PROMPT_NAME:
            text = system_text()
        else:
            template = templates()[name][1]
            values = params.arguments or {}
            missing = [v for v in template.input_variables if v not in values]
            if missing:
                raise MCPError(types.INVALID_PARAMS, f"prompt {name!r} needs the arguments {missing}")
            text = template.format_messages(**values)[-1].text  # the topic's request, after the system prompt
        return types.GetPromptResult(
            description=prompts()[name].description,
            messages=[types.PromptMessage(role="user", content=types.TextContent(type="text", text=text))],
        )

    return list_prompts, get_prompt


def quiet_sdk_loggers(level: int = logging.WARNING) -> None:
    """Keep the SDK's per-request and per-session INFO lines (and the HTTP clients') off stderr; warnings and
    errors still show."""
    for name in CHATTY_SDK_LOGGERS:
        logging.getLogger(name).setLevel(level)


def _refuse_invalid_unicode(arguments: Any) -> None:
    """Raise the error the stdio reader's marker stands for (see :func:`_answerable_message`)."""
    if isinstance(arguments, dict) and set(arguments) == {INVALID_UNICODE_ARGUMENT}:
        marker = arguments[INVALID_UNICODE_ARGUMENT]
        if isinstance(marker, dict) and isinstance(marker.get("message"), str):
            raise InvalidInputError(marker["message"], field=marker.get("field"))


def _lone_surrogate(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first string (or key) inside ``value`` that cannot be UTF-8 encoded, with where it is; or None."""
    if isinstance(value, str):
        return (path, value) if _LONE_SURROGATE.search(value) else None
    pairs: Iterable[tuple[str, Any]]
    if isinstance(value, dict):
        keys = ((f"{path} key", key) for key in value)
        pairs = itertools.chain(keys, ((f"{path}.{key}" if path else str(key), item) for key, item in value.items()))
    elif isinstance(value, list):
        pairs = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    return next((found for where, item in pairs if (found := _lone_surrogate(item, where)) is not None), None)


def _answerable_message(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` made answerable when it holds lone surrogates (``"\\ud800"``, valid JSON but not Unicode).

    The SDK cannot write a string holding one, so it would leave the request unanswered: the client would wait
    forever. A ``tools/call`` gets its arguments replaced by a marker the tool answers with an error naming the
    argument; any other message gets U+FFFD in place of each lone surrogate. Other messages are unchanged.
    """
    if _lone_surrogate(message) is None:
        return message  # surrogate pairs only: valid Unicode
    params = message.get("params")
    found = _lone_surrogate(params.get("arguments")) if isinstance(params, dict) else None
    if message.get("method") == "tools/call" and isinstance(params, dict) and found is not None:
        from agent_tools.inspector import check_unicode  # only for a string that holds a lone surrogate

        try:
            check_unicode(found[1], field=found[0])
        except InvalidInputError as exc:
            params["arguments"] = {INVALID_UNICODE_ARGUMENT: {"message": exc.message, "field": exc.field}}
    written = json.dumps(message, ensure_ascii=False)  # every string and key, lone surrogates as they are
    replaced: dict[str, Any] = json.loads(_LONE_SURROGATE.sub("\ufffd", written))
    return replaced


def _params_problem(message: dict[str, Any], request_id: str | int | None) -> RpcProblem | None:
    """-32602 naming the first bad parameter of a request whose method is known (the SDK would say only
    "Invalid request parameters" and log the whole union's errors)."""
    try:
        REQUEST_TYPES[message["method"]].model_validate(message, by_name=False)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "params"
        return RpcProblem(types.INVALID_PARAMS, f"Invalid params: {where}: {first.get('msg')}", request_id)
    return None


def parse_line(raw: bytes) -> Any:
    """The message one stdin line holds, ready for the SDK (None for a blank line).

    Raises :class:`RpcProblem` for a line the SDK would log and leave unanswered — the client would wait for
    ever: not UTF-8 or not JSON (-32700), not one well-formed message (-32600, :func:`read_message
    <agent_tools.mcp_front.read_message>`), an unknown method (-32601), parameters its method refuses (-32602).
    """
    message = read_message(raw)
    if message is None:
        return None
    request_id = message.get("id")
    if "method" in message and valid_id(request_id):
        if message["method"] not in REQUEST_TYPES:
            raise RpcProblem(types.METHOD_NOT_FOUND, f"Method not found: {message['method'][:100]!r}", request_id)
        if (problem := _params_problem(message, request_id)) is not None:
            raise problem
    try:
        return types.jsonrpc_message_adapter.validate_python(_answerable_message(message), by_name=False)
    except ValueError as exc:  # pydantic's ValidationError: no request, notification or response shape
        msg = "Invalid Request: not a JSON-RPC request, notification or response"
        raise RpcProblem(types.INVALID_REQUEST, msg, message.get("id")) from exc


def _read_stdin(binary: Any, lines: MemoryObjectSendStream[bytes], token: Any, on_end: Callable[[], None]) -> None:
    """Feed stdin's lines (at most MAX_LINE_BYTES + 1 bytes at a time) to the event loop; runs in a daemon thread,
    so a server ending for any reason never waits for a blocked ``readline`` (it hung until stdin closed).
    ``on_end`` runs when stdin ends (the client is gone): the calls still running are stopped."""
    try:
        while True:
            try:
                raw = binary.readline(MAX_LINE_BYTES + 1)
            except (OSError, ValueError):  # stdin broken or closed under us: the client is gone as well
                raw = b""
            if not raw:
                break
            anyio.from_thread.run(lines.send, raw, token=token)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.RunFinishedError):
        return  # the server is ending on its own
    on_end()
    try:
        anyio.from_thread.run(lines.aclose, token=token)
    except anyio.RunFinishedError:
        return


def _stdin_closed(exit_after: float | None) -> None:
    """The client closed stdin: stop every running call; with ``exit_after``, end the process that many seconds
    after the requests read had ``STOP_GRACE_SECONDS`` to be answered, if it is still alive (a stretch of work
    without a checkpoint must not keep a server nobody can reach: it hung for minutes). Only the ``mcp`` command
    asks for the exit; a test serving in-process does not."""
    stopped = stop_running_calls("the client closed the connection")
    if stopped:
        logger.info("stdin closed: stopping %d running call(s)", stopped)
    if exit_after is None:
        return

    def exit_later() -> None:
        time.sleep(STOP_GRACE_SECONDS + exit_after)
        logger.warning("a call did not stop within %.1f s of stdin closing; exiting", STOP_GRACE_SECONDS + exit_after)
        exit_flushed(0, (sys.stderr, sys.__stderr__))

    threading.Thread(target=exit_later, name="stdin-closed exit", daemon=True).start()


class _Unanswered:
    """The requests passed to the SDK and not answered yet. When stdin ends, the read stream closes only once they
    are answered: the SDK ends a session as soon as its read stream closes, cancelling the handlers still running,
    so a client that closed stdin right after ``tools/list`` got only the ``initialize`` answer."""

    def __init__(self) -> None:
        self.ids: dict[str | int, int] = {}

    def sent(self, message: Any) -> None:
        if isinstance(message, types.JSONRPCRequest):
            self.ids[message.id] = self.ids.get(message.id, 0) + 1
        elif isinstance(message, types.JSONRPCNotification) and message.method == "notifications/cancelled":
            cancelled = (message.params or {}).get("requestId")  # the protocol: a cancelled request gets no answer
            if valid_id(cancelled):
                self.answered(cancelled)

    def answered(self, request_id: Any) -> None:
        left = self.ids.pop(request_id, 0) - 1
        if left > 0:
            self.ids[request_id] = left

    async def settled(self, limit: float) -> None:
        """Wait until every request sent has its answer (at most ``limit`` seconds), stopping the calls meanwhile:
        those that had not started when stdin ended too (the SDK dispatches the last lines after it ended)."""
        with anyio.move_on_after(limit):
            while self.ids:
                stop_running_calls("the client closed the connection")
                await anyio.sleep(0.02)


async def _route_lines(
    lines: MemoryObjectReceiveStream[bytes],
    messages: MemoryObjectSendStream[SessionMessage | Exception],
    write: Any,
    unanswered: _Unanswered,
) -> None:
    """Each line to the SDK as a message, or answered here with its JSON-RPC error; the rest of a line over
    ``MAX_LINE_BYTES`` is skipped. At stdin's end, the requests passed on are answered before the SDK's read
    stream closes."""
    skipping = False
    async with lines, messages:
        async for raw in lines:
            if skipping:
                skipping = not raw.endswith(b"\n")
                continue
            skipping = len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n")
            try:
                message = parse_line(raw)
            except RpcProblem as problem:
                logger.warning("answered a malformed message with %d: %s", problem.code, problem.message)
                await write(problem.answer())
                continue
            if message is not None:
                unanswered.sent(message)
                await messages.send(SessionMessage(message))
        await unanswered.settled(STOP_GRACE_SECONDS)


async def serve_stdio(
    server: Server[Any],
    *,
    stdin: Any = None,
    stdout: Any = None,
    exit_after_close: float | None = None,
    drop_answer_to: str | None = None,
) -> None:
    """Serve over stdio until the client closes the pipe: the SDK's transport, plus an answer for every malformed
    line.

    ``stdin`` is a binary file (``sys.stdin.buffer`` by default; or what :meth:`StdioFront.handoff
    <agent_tools.mcp_front.StdioFront.handoff>` returns, with ``drop_answer_to`` its replayed ``initialize``'s id,
    whose answer is not written): lines are decoded here, strictly, so invalid UTF-8 is answered as an error
    instead of being replaced and analysed. ``stdout`` is an anyio text file. When stdin closes, every request read
    is answered (the calls still running are stopped at their next checkpoint, those waiting for the model at
    once); with ``exit_after_close`` the process also ends that many seconds later if it is still alive (a server
    process, not a test).
    """
    import io

    if stdin is None:
        stdin = sys.stdin.buffer
    if stdout is None:
        stdout = anyio.wrap_file(io.TextIOWrapper(sys.stdout.buffer, encoding="utf-8"))
    unanswered = _Unanswered()
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)
    line_writer, line_reader = anyio.create_memory_object_stream[bytes](0)
    output_lock = anyio.Lock()

    async def write(line: str) -> None:
        async with output_lock:
            await stdout.write(line + "\n")
            await stdout.flush()

    async def write_messages() -> None:
        async with write_reader:
            async for message in write_reader:
                sent = message.message
                if isinstance(sent, types.JSONRPCResponse | types.JSONRPCError):
                    unanswered.answered(sent.id)
                    if drop_answer_to is not None and sent.id == drop_answer_to:
                        if isinstance(sent, types.JSONRPCError):  # the front's answer said otherwise: a bug
                            logger.error("the SDK refused the replayed initialize: %s", sent.error.message)
                        continue
                await write(sent.model_dump_json(by_alias=True, exclude_unset=True))

    on_end = partial(_stdin_closed, exit_after_close)
    reader = threading.Thread(
        target=_read_stdin, args=(stdin, line_writer, anyio.lowlevel.current_token(), on_end), daemon=True
    )
    async with anyio.create_task_group() as group:
        group.start_soon(_route_lines, line_reader, read_writer, write, unanswered)
        group.start_soon(write_messages)
        reader.start()
        await server.run(read_stream, write_stream, server.create_initialization_options(NotificationOptions()))
        group.cancel_scope.cancel()


def _closed_stream_noise(record: logging.LogRecord) -> bool:
    """False for the SDK's traceback when a client ends its session while its GET stream is open (the normal
    way a session ends: ``DELETE``); every other record passes."""
    error = record.exc_info[1] if record.exc_info else None
    return not isinstance(error, anyio.ClosedResourceError)


async def _read_post(receive: Any) -> tuple[bytes, RpcProblem | None]:
    """A POST's body, and the JSON-RPC error it gets here when the SDK would answer it wrongly or not at all.

    The SDK's HTTP transport took a request with an object as id for a notification (202, no answer: the client
    waited for ever) and answered a batch or a missing ``"jsonrpc"`` with -32602; the stdio checks
    (:func:`parse_line`) answer each as JSON-RPC says. Well-formed bodies go on to the SDK unchanged.
    """
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_LINE_BYTES:  # past it parse_line refuses the body: the rest is not read
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), None  # disconnected: the SDK sees the same
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    try:
        parse_line(body)
    except RpcProblem as problem:
        return body, problem
    return body, None


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI ``receive`` that gives ``body`` once, then whatever the connection says next."""
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        message: dict[str, Any] = await receive()
        return message

    return replayed


async def _send_rpc_error(send: Any, problem: RpcProblem) -> None:
    logger.warning("answered a malformed HTTP message with %d: %s", problem.code, problem.message)
    payload = problem.answer().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve_http(
    server: Server[Any],
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    path: str = "/mcp",
    max_sessions: int | None = DEFAULT_MAX_SESSIONS,
    session_idle: float | None = DEFAULT_SESSION_IDLE_SECONDS,
) -> None:
    """Serve over streamable HTTP at ``http://host:port/path``; loopback by default, with DNS-rebinding protection.

    At most ``max_sessions`` sessions are open at once (a client opening one more gets 503 until one ends), and a
    session without a request for ``session_idle`` seconds is closed (its id then answers 404): clients that
    never close their sessions no longer grow the server (2,000 of them held 88 MB for the SDK's 30 minutes).
    The server's lifespan (loading the default model) runs once, as the server starts, before the address is
    announced; every session shares it.
    """
    import uvicorn
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
    from mcp.server.transport_security import TransportSecuritySettings
    from starlette.applications import Starlette
    from starlette.routing import Route

    security = None
    if is_loopback(host):
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
        )
    else:
        print(
            f"warning: serving MCP on {host}, reachable beyond this machine, without authentication",
            file=sys.stderr,
        )
    manager = StreamableHTTPSessionManager(
        app=server, security_settings=security, max_sessions=max_sessions, session_idle_timeout=session_idle
    )
    sdk_log = logging.getLogger("mcp.server.streamable_http")
    if _closed_stream_noise not in sdk_log.filters:
        sdk_log.addFilter(_closed_stream_noise)

    class Endpoint:  # an ASGI app (a class, so Starlette's Route passes scope/receive/send through)
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope.get("method") == "POST":
                body, problem = await _read_post(receive)
                if problem is not None:
                    await _send_rpc_error(send, problem)
                    return
                receive = _replay(body, receive)
            await manager.handle_request(scope, receive, send)

    @asynccontextmanager
    async def announced(_app: Starlette) -> AsyncIterator[None]:
        async with manager.run():  # the model is loaded here, before uvicorn accepts a connection
            print(f"attention-explainer MCP server on http://{host}:{port}{path}", file=sys.stderr, flush=True)
            yield

    app = Starlette(routes=[Route(path, endpoint=Endpoint())], lifespan=announced)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning")
    await uvicorn.Server(config).serve()
