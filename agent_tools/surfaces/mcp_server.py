"""MCP surface: every declared tool as an MCP tool with an input schema, an output schema and structured content.

Built on the official SDK's low-level ``Server`` because the tools are generated from their declarations
(pydantic input and output models), not written as decorated functions. The session's policy is fixed when
the server is built (by the ``attention-explainer mcp`` options): which models may be loaded (an allow-list,
exposed to clients as an enum), the artifact folder and the token limit. Nothing an agent sends can widen
them. The default model is loaded once, in the server's lifespan, before the first request is answered.

Results: ``structuredContent`` is the tool's report (``output_model.model_dump(mode="json")``, validated
against the advertised ``outputSchema``); the text content is the concise summary an LLM reads, followed by
the same JSON for clients that only read text. Expected failures come back as tool errors (``isError``) whose
text names what is valid; a bug is logged with its traceback and reported as an internal error.

The explanation templates are offered as MCP prompts, and the system prompt as the server's instructions.

Reliability: a call runs in a worker thread under a :class:`~agent_tools.inspector.CallContext`. A client's
``notifications/cancelled`` (or the operator's ``call_timeout``) stops the pass at its next checkpoint — between
layers, query chunks and generation steps — which releases the model's lock; the server keeps serving. On stdio,
every line gets the JSON-RPC answer it deserves: -32700 for what is not JSON (or not UTF-8), -32600 for what is
not a request (a batch, no ``"jsonrpc": "2.0"``, an object as id, ``params`` a string, deep nesting), -32601 for
an unknown method. Over HTTP the number of sessions and their idle time are capped.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import cache, partial
from typing import Any, Literal, get_args

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp import types
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from agent_tools import __version__
from agent_tools.errors import AttentionToolError, CallCancelledError, DeadlineExceededError, InvalidInputError
from agent_tools.inspector import CallContext, Inspector, call_scope, check_list_lengths, check_unicode
from agent_tools.prompts import TOPICS, Topic, explanation_template, system_prompt, topic_file
from agent_tools.surfaces import agent_input_model, concise_text, error_text, select_tools
from agent_tools.tools.registry import ToolSpec

logger = logging.getLogger(__name__)

SERVER_NAME = "attention-explainer"
TextContentMode = Literal["summary", "json", "both"]
TEXT_CONTENT_MODES: tuple[str, ...] = get_args(TextContentMode)
Transport = Literal["stdio", "streamable-http"]
TRANSPORTS: tuple[str, ...] = get_args(Transport)
SYSTEM_PROMPT_NAME = "attention_explainer"
# Arguments that stood for a string that is valid JSON but not valid Unicode (a lone surrogate escape such as
# "\\ud800"): the SDK cannot parse such a line and would leave the request unanswered, so the stdio reader
# swaps the arguments for this marker and the tool answers with an error naming the argument.
INVALID_UNICODE_ARGUMENT = "_invalid_unicode"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Past the call timeout, the handler answers after this grace even if the worker has not reached a checkpoint
# (a non-capturing stretch of a tool); the worker still stops at its next one.
STOP_GRACE_SECONDS = 5.0
PROGRESS_EVERY_SECONDS = 2.0
DEFAULT_MAX_SESSIONS = 64  # HTTP sessions open at once; the SDK's 10,000 idle sessions held +88 MB per 2,000
DEFAULT_SESSION_IDLE_SECONDS = 600.0  # an HTTP session with no request for this long is closed (SDK: 30 min)
MAX_LINE_BYTES = 16 << 20  # one stdio message; a longer line is refused and skipped
MAX_JSON_DEPTH = 64  # nesting of one message; MCP messages need about 8


def output_schema(spec: ToolSpec) -> dict[str, Any]:
    """The JSON schema of what the tool returns as structured content (its report, serialised)."""
    return spec.output_model.model_json_schema(mode="serialization")


def mcp_tool(spec: ToolSpec, inspector: Inspector) -> types.Tool:
    """The MCP declaration of one tool: input schema (``model`` narrowed to the allow-list) and output schema."""
    return types.Tool(
        name=spec.name,
        title=spec.name.replace("_", " ").capitalize(),
        description=spec.description,
        inputSchema=agent_input_model(spec, inspector.policy).model_json_schema(),
        outputSchema=output_schema(spec),
        annotations=types.ToolAnnotations(destructiveHint=False, idempotentHint=True, openWorldHint=False),
    )


def _text_blocks(report_text: str, structured: dict[str, Any], mode: TextContentMode) -> list[types.TextContent]:
    blocks = []
    if mode in ("summary", "both"):
        blocks.append(types.TextContent(type="text", text=report_text))
    if mode in ("json", "both"):
        blocks.append(types.TextContent(type="text", text=json.dumps(structured, ensure_ascii=False)))
    return blocks


def _error_result(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], isError=True)


def _prompt_definitions(tool_names: list[str]) -> dict[str, types.Prompt]:
    prompts = {
        SYSTEM_PROMPT_NAME: types.Prompt(
            name=SYSTEM_PROMPT_NAME,
            title="Attention explainer (system prompt)",
            description="How to use these tools and how to reason about attention (the server's instructions).",
            arguments=[],
        )
    }
    for topic in TOPICS:
        template = explanation_template(topic, tools=tool_names)
        name = f"explain_{topic}"
        prompts[name] = types.Prompt(
            name=name,
            title=f"Explain {topic.replace('_', ' ')}",
            description=topic_file(topic).description,
            arguments=[types.PromptArgument(name=v, required=True) for v in template.input_variables],
        )
    return prompts


def build_server(
    inspector: Inspector,
    *,
    tools: Iterable[str] | None = None,
    text_content: TextContentMode = "both",
    preload: bool = True,
    call_timeout: float | None = None,
) -> Server:
    """An MCP server serving the declared tools (or the named subset) through ``inspector``.

    Args:
        inspector: the session: its policy is the allow-list of models, its folder the only place files go.
        tools: names of the tools to serve; all declared tools when omitted.
        text_content: what the text content holds besides the structured content: the concise summary,
            the JSON of the report, or both (the default; clients that ignore structured content still
            get every number).
        preload: load the session's default model in the lifespan, before the first request is answered.
        call_timeout: seconds a tool call may run; past it the call is stopped and answered with a
            ``deadline_exceeded`` tool error (None: no limit; the ``mcp`` command defaults to 120 s).
    """
    if text_content not in TEXT_CONTENT_MODES:
        raise InvalidInputError(f"text_content must be one of {TEXT_CONTENT_MODES}, got {text_content!r}")
    if call_timeout is not None and not call_timeout > 0:
        raise InvalidInputError(f"call_timeout must be a positive number of seconds, got {call_timeout!r}")
    specs = {spec.name: spec for spec in select_tools(tools)}
    instructions = system_prompt(tools=list(specs), default_model=inspector.policy.default)
    server: Server = Server(
        SERVER_NAME, version=__version__, instructions=instructions, lifespan=_lifespan(inspector, preload=preload)
    )
    _serve_tools(server, inspector, specs, text_content, call_timeout)
    _serve_prompts(server, list(specs), instructions)
    return server


def _lifespan(inspector: Inspector, *, preload: bool) -> Callable[[Server], AbstractAsyncContextManager[Any]]:
    """The server's lifespan: load the default model (when ``preload``) before the first request is answered."""

    @asynccontextmanager
    async def lifespan(_server: Server) -> AsyncIterator[dict[str, Any]]:
        if preload:
            try:
                loaded = await anyio.to_thread.run_sync(inspector.model, None)
            except AttentionToolError as exc:
                # A model that cannot load (a cache that cannot be rebuilt, a missing package) must not end the
                # server before it answers ``initialize``: say it in one line; each call that needs the model
                # then gets the same message as its tool error.
                logger.error("the default model did not load: %s", " ".join(exc.message.splitlines()))
            else:
                logger.info("loaded %s in %.1f s", loaded.name, loaded.load_seconds)
        yield {"inspector": inspector}

    return lifespan


def _serve_tools(
    server: Server,
    inspector: Inspector,
    specs: dict[str, ToolSpec],
    text_content: TextContentMode,
    call_timeout: float | None = None,
) -> None:
    """``tools/list`` and ``tools/call``: each tool runs in a worker thread; expected failures are tool errors."""
    declarations = [mcp_tool(spec, inspector) for spec in specs.values()]

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        return declarations

    @server.call_tool(validate_input=False)  # the tool's pydantic model validates, with messages naming what is valid
    async def call_tool(name: str, arguments: dict[str, Any]) -> Any:
        spec = specs.get(name)
        if spec is None:
            return _error_result(f"Error [invalid_input]: unknown tool {name!r}; tools: {', '.join(specs)}")
        problem = _invalid_unicode_problem(arguments) or _list_length_problem(arguments)
        if problem is not None:
            return _error_result(error_text(name, problem))
        context = CallContext(timeout=call_timeout, progress_every=PROGRESS_EVERY_SECONDS)
        context.progress = _progress_reporter(server, context)
        try:
            report = await _run_call(spec, inspector, arguments, context)
        except CallCancelledError as exc:
            return _error_result(stopped_text(name, exc))
        except AttentionToolError as exc:
            return _error_result(error_text(name, exc))
        except Exception as exc:  # a bug: keep serving, log the traceback, tell the client plainly
            logger.exception("tool %s failed on %r", name, arguments)
            return _error_result(f"Internal error in {name}: {type(exc).__name__}: {exc}")
        structured = report.model_dump(mode="json")
        return _text_blocks(concise_text(report), structured, text_content), structured


async def _run_call(spec: ToolSpec, inspector: Inspector, arguments: dict[str, Any], context: CallContext) -> Any:
    """Run one tool call in a worker thread under ``context``; return its report.

    Why ``abandon_on_cancel``: when the client cancels, the SDK answers "Request cancelled" itself and cancels
    this handler. Waiting for the thread and then answering too tripped the SDK's "Request already responded to"
    assertion, which ended the stdio server (and an HTTP session). Instead the handler gives up at once and
    cancels ``context``; the thread stops at its next checkpoint and releases the model's lock. Past the call
    timeout (plus a short grace for stretches without a checkpoint) the handler answers the same way.
    """
    work = partial(_call_in_scope, spec, inspector, arguments, context)
    limit = None if context.timeout is None else context.timeout + STOP_GRACE_SECONDS
    try:
        with anyio.move_on_after(limit) as scope:
            return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        context.cancel("the client cancelled it")
        raise
    assert scope.cancelled_caught
    context.cancel("it ran past the time limit")
    msg = f"the call ran past this server's time limit of {context.timeout:g} s and was stopped; ask for less"
    raise DeadlineExceededError(msg)


def _call_in_scope(spec: ToolSpec, inspector: Inspector, arguments: dict[str, Any], context: CallContext) -> Any:
    """The worker thread's part: the tool under ``context`` (its passes check it); a stop is logged in one line."""
    with call_scope(context):
        try:
            return spec(inspector, arguments)
        except CallCancelledError as exc:
            logger.info("%s stopped after %.1f s (%s)", spec.name, context.elapsed, exc.kind)
            raise


def _progress_reporter(server: Server, context: CallContext) -> Callable[[float], None] | None:
    """Progress notifications for a request that asked for them (``_meta.progressToken``), sent from the worker.

    They say the call is alive and how far it is toward the time limit (``total``), so a client that resets its
    own timeout on progress does not give up on a long call.
    """
    request = server.request_context
    token = request.meta.progressToken if request.meta is not None else None
    if token is None:
        return None
    session, related = request.session, str(request.request_id)

    def report(elapsed: float) -> None:
        if context.cancelled:
            return
        message = f"running for {elapsed:.0f} s"
        try:
            anyio.from_thread.run(
                partial(session.send_progress_notification, token, round(elapsed, 2), context.timeout, message, related)
            )
        except Exception:  # the client went away, or the loop is closing: progress is best effort
            logger.debug("progress notification not sent", exc_info=True)

    return report


def stopped_text(tool: str, error: CallCancelledError) -> str:
    """The tool error of a call stopped before it finished: why, and what to do (not "fix the arguments")."""
    return f"Error [{error.kind}]: {error.message.rstrip('.')}. Nothing was computed; {tool} can be called again."


def _list_length_problem(arguments: Any) -> InvalidInputError | None:
    try:
        check_list_lengths(arguments)
    except InvalidInputError as exc:
        return exc
    return None


def _serve_prompts(server: Server, tool_names: list[str], instructions: str) -> None:
    """``prompts/list`` and ``prompts/get``: the system prompt (the server's instructions) and one explanation
    template per topic, mentioning only the tools served."""
    prompts = _prompt_definitions(tool_names)
    topics: dict[str, Topic] = {f"explain_{topic}": topic for topic in TOPICS}

    @server.list_prompts()
    async def list_prompts() -> list[types.Prompt]:
        return list(prompts.values())

    @server.get_prompt()
    async def get_prompt(name: str, arguments: dict[str, str] | None) -> types.GetPromptResult:
        if name not in prompts:
            raise ValueError(f"unknown prompt {name!r}; prompts: {', '.join(prompts)}")
        if name == SYSTEM_PROMPT_NAME:
            text = instructions
        else:
            template = explanation_template(topics[name], tools=tool_names)
            values = arguments or {}
            missing = [v for v in template.input_variables if v not in values]
            if missing:
                raise ValueError(f"prompt {name!r} needs the arguments {missing}")
            text = template.format_messages(**values)[-1].text  # the topic's request, after the system prompt
        return types.GetPromptResult(
            description=prompts[name].description,
            messages=[types.PromptMessage(role="user", content=types.TextContent(type="text", text=text))],
        )


def initialization_options(server: Server) -> Any:
    return server.create_initialization_options(NotificationOptions())


def _invalid_unicode_problem(arguments: Any) -> InvalidInputError | None:
    if isinstance(arguments, dict) and set(arguments) == {INVALID_UNICODE_ARGUMENT}:
        marker = arguments[INVALID_UNICODE_ARGUMENT]
        if isinstance(marker, dict) and isinstance(marker.get("message"), str):
            return InvalidInputError(marker["message"], field=marker.get("field"))
    return None


def _first_invalid_unicode(value: Any, path: str) -> InvalidInputError | None:
    """The error for the first string (or key) inside ``value`` that cannot be UTF-8 encoded, or None."""
    if isinstance(value, str):
        try:
            check_unicode(value, field=path)
        except InvalidInputError as exc:
            return exc
        return None
    items: Iterable[tuple[str, Any]] = ()
    if isinstance(value, dict):
        for key in value:
            if isinstance(key, str) and (problem := _first_invalid_unicode(key, f"{path} key")) is not None:
                return problem
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    for where, item in items:
        if (problem := _first_invalid_unicode(item, where)) is not None:
            return problem
    return None


def _replace_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_replace_surrogates(k): _replace_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_surrogates(v) for v in value]
    return value


def _answerable_message(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with lone surrogates made answerable (see :func:`answerable_line`); other messages unchanged."""
    if _first_invalid_unicode(message, "") is None:
        return message  # surrogate pairs only: valid Unicode
    params = message.get("params")
    if message.get("method") == "tools/call" and isinstance(params, dict):
        problem = _first_invalid_unicode(params.get("arguments"), "")
        if problem is not None:
            params["arguments"] = {INVALID_UNICODE_ARGUMENT: {"message": problem.message, "field": problem.field}}
    replaced: dict[str, Any] = _replace_surrogates(message)
    return replaced


def answerable_line(line: str) -> str:
    """A protocol line the SDK can parse, for a line that is valid JSON holding lone surrogate escapes.

    Strict JSON parsers refuse ``"\\ud800"`` (a lone surrogate), so the SDK would log the line and never answer
    the request: the client would wait forever. A ``tools/call`` gets its arguments replaced by a marker the tool
    answers with an error naming the argument; any other message gets U+FFFD in place of each lone surrogate.
    Other lines pass through unchanged (malformed JSON is answered by :func:`parse_line`).
    """
    if not _SURROGATE_ESCAPE.search(line):
        return line
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return line
    if not isinstance(message, dict) or _first_invalid_unicode(message, "") is None:
        return line
    return json.dumps(_answerable_message(message), ensure_ascii=False)


class RpcProblem(Exception):
    """A stdin line that gets a JSON-RPC error answer here, instead of reaching the SDK (which would drop it)."""

    def __init__(self, code: int, message: str, request_id: str | int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id

    def answer(self) -> str:
        """The error response line (``id`` null when the request's id could not be read, as JSON-RPC says)."""
        error = {"code": self.code, "message": self.message}
        return json.dumps({"jsonrpc": "2.0", "id": self.request_id, "error": error}, ensure_ascii=False)


@cache
def _request_types() -> dict[str, Any]:
    """The request model of every method a client may call in this SDK's protocol version (others get -32601)."""
    union = types.ClientRequest.model_fields["root"].annotation
    return {
        method: member for member in get_args(union) for method in get_args(member.model_fields["method"].annotation)
    }


def _params_problem(message: dict[str, Any], request_id: str | int) -> RpcProblem | None:
    """-32602 naming the first bad parameter of a request whose method is known (the SDK would say only
    "Invalid request parameters" and log the whole union's errors)."""
    try:
        _request_types()[message["method"]].model_validate(message)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "params"
        return RpcProblem(types.INVALID_PARAMS, f"Invalid params: {where}: {first.get('msg')}", request_id)
    return None


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than ``limit`` levels (iterative: deep input costs no recursion)."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        if children and depth > limit:
            return True
        pending.extend((child, depth + 1) for child in children)
    return False


def _valid_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _lenient_id(raw: bytes) -> str | int | None:
    """The id of a line that is JSON once its bad bytes are replaced, so the client's request still gets an
    answer (an error: the replaced text itself is never analysed)."""
    try:
        value = json.loads(raw.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return None
    request_id = value.get("id") if isinstance(value, dict) else None
    return request_id if _valid_id(request_id) else None


def _checked_envelope(value: Any) -> dict[str, Any]:
    """``value`` if it is a single JSON-RPC 2.0 message this server can route; else the problem to answer."""
    if isinstance(value, list):
        raise RpcProblem(types.INVALID_REQUEST, "Invalid Request: batches are not supported; send one message a line")
    if not isinstance(value, dict):
        raise RpcProblem(types.INVALID_REQUEST, "Invalid Request: a message must be a JSON object")
    request_id = value.get("id")
    answer_id = request_id if _valid_id(request_id) else None
    if "id" in value and answer_id is None:
        raise RpcProblem(types.INVALID_REQUEST, "Invalid Request: id must be a string or an integer")
    if value.get("jsonrpc") != "2.0":
        raise RpcProblem(types.INVALID_REQUEST, 'Invalid Request: "jsonrpc" must be "2.0"', answer_id)
    if _deeper_than(value, MAX_JSON_DEPTH):
        msg = f"Invalid Request: nested deeper than {MAX_JSON_DEPTH} levels"
        raise RpcProblem(types.INVALID_REQUEST, msg, answer_id)
    if "method" in value:
        method, params = value["method"], value.get("params")
        if not isinstance(method, str):
            raise RpcProblem(types.INVALID_REQUEST, "Invalid Request: method must be a string", answer_id)
        if params is not None and not isinstance(params, dict):
            raise RpcProblem(types.INVALID_REQUEST, "Invalid Request: params must be an object", answer_id)
        if answer_id is not None and method not in _request_types():
            raise RpcProblem(types.METHOD_NOT_FOUND, f"Method not found: {method[:100]!r}", answer_id)
        if answer_id is not None and (problem := _params_problem(value, answer_id)) is not None:
            raise problem
    return value


def parse_line(raw: bytes) -> types.JSONRPCMessage | None:
    """The message one stdin line holds, ready for the SDK (None for a blank line).

    Raises :class:`RpcProblem` for a line the SDK would log and leave unanswered — the client would wait for
    ever: not UTF-8 or not JSON (-32700), not one well-formed message (-32600), an unknown method (-32601).
    """
    if not raw.strip():
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        msg = f"Parse error: the message is not valid UTF-8 (byte {exc.start}); send UTF-8 JSON"
        raise RpcProblem(types.PARSE_ERROR, msg, _lenient_id(raw)) from exc
    try:
        value = json.loads(text)
    except RecursionError as exc:
        msg = f"Parse error: nested too deeply to parse; at most {MAX_JSON_DEPTH} levels are accepted"
        raise RpcProblem(types.PARSE_ERROR, msg) from exc
    except ValueError as exc:
        raise RpcProblem(types.PARSE_ERROR, f"Parse error: not valid JSON ({exc})") from exc
    message = _checked_envelope(value)
    try:
        return types.JSONRPCMessage.model_validate(_answerable_message(message))
    except ValueError as exc:  # pydantic's ValidationError: no request, notification or response shape
        msg = "Invalid Request: not a JSON-RPC request, notification or response"
        raise RpcProblem(types.INVALID_REQUEST, msg, message.get("id")) from exc


def _read_stdin(binary: Any, lines: MemoryObjectSendStream[bytes], token: Any) -> None:
    """Feed stdin's lines (at most MAX_LINE_BYTES + 1 bytes at a time) to the event loop; runs in a daemon thread,
    so a server ending for any reason never waits for a blocked ``readline`` (it hung until stdin closed)."""
    try:
        while raw := binary.readline(MAX_LINE_BYTES + 1):
            anyio.from_thread.run(lines.send, raw, token=token)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.RunFinishedError, OSError, ValueError):
        return
    try:
        anyio.from_thread.run(lines.aclose, token=token)
    except anyio.RunFinishedError:
        return


async def _route_lines(
    lines: MemoryObjectReceiveStream[bytes], messages: MemoryObjectSendStream[SessionMessage | Exception], write: Any
) -> None:
    """Each line to the SDK as a message, or answered here with its JSON-RPC error; oversize lines are skipped."""
    skipping = False
    async with lines, messages:
        async for raw in lines:
            if skipping:
                skipping = not raw.endswith(b"\n")
                continue
            try:
                if len(raw) > MAX_LINE_BYTES:
                    skipping = not raw.endswith(b"\n")
                    raise RpcProblem(types.INVALID_REQUEST, f"Invalid Request: a message over {MAX_LINE_BYTES:,} bytes")
                message = parse_line(raw)
            except RpcProblem as problem:
                logger.warning("answered a malformed message with %d: %s", problem.code, problem.message)
                await write(problem.answer())
                continue
            if message is not None:
                await messages.send(SessionMessage(message))


@asynccontextmanager
async def _stdio_streams(binary: Any, stdout: Any) -> AsyncIterator[tuple[Any, Any]]:
    """The stdio transport (the SDK's, plus an answer for every malformed line): read and write streams."""
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
                await write(message.message.model_dump_json(by_alias=True, exclude_none=True))

    reader = threading.Thread(
        target=_read_stdin, args=(binary, line_writer, anyio.lowlevel.current_token()), daemon=True
    )
    async with anyio.create_task_group() as group:
        group.start_soon(_route_lines, line_reader, read_writer, write)
        group.start_soon(write_messages)
        reader.start()
        try:
            yield read_stream, write_stream
        finally:
            group.cancel_scope.cancel()


async def serve_stdio(server: Server, *, stdin: Any = None, stdout: Any = None) -> None:
    """Serve over stdio until the client closes the pipe.

    ``stdin`` is a binary file (``sys.stdin.buffer`` by default): lines are decoded here, strictly, so invalid
    UTF-8 is answered as an error instead of being replaced and analysed. ``stdout`` is an anyio text file.
    """
    import io

    if stdin is None:
        stdin = sys.stdin.buffer
    if stdout is None:
        stdout = anyio.wrap_file(io.TextIOWrapper(sys.stdout.buffer, encoding="utf-8"))
    async with _stdio_streams(stdin, stdout) as (read_stream, write_stream):
        await server.run(read_stream, write_stream, initialization_options(server))


def _closed_stream_noise(record: logging.LogRecord) -> bool:
    """False for the SDK's traceback when a client ends its session while its GET stream is open (the normal
    way a session ends: ``DELETE``); every other record passes."""
    error = record.exc_info[1] if record.exc_info else None
    return not isinstance(error, anyio.ClosedResourceError)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve_http(
    server: Server,
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
            await manager.handle_request(scope, receive, send)

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with manager.run():
            yield

    app = Starlette(routes=[Route(path, endpoint=Endpoint())], lifespan=lifespan)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning")
    print(f"attention-explainer MCP server on http://{host}:{port}{path}", file=sys.stderr, flush=True)
    await uvicorn.Server(config).serve()
