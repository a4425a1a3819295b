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
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any, Literal, get_args

import anyio
import anyio.to_thread
from mcp import types
from mcp.server.lowlevel import NotificationOptions, Server

from agent_tools import __version__
from agent_tools.errors import AttentionToolError, InvalidInputError
from agent_tools.inspector import Inspector, check_unicode
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
) -> Server:
    """An MCP server serving the declared tools (or the named subset) through ``inspector``.

    Args:
        inspector: the session: its policy is the allow-list of models, its folder the only place files go.
        tools: names of the tools to serve; all declared tools when omitted.
        text_content: what the text content holds besides the structured content: the concise summary,
            the JSON of the report, or both (the default; clients that ignore structured content still
            get every number).
        preload: load the session's default model in the lifespan, before the first request is answered.
    """
    if text_content not in TEXT_CONTENT_MODES:
        raise InvalidInputError(f"text_content must be one of {TEXT_CONTENT_MODES}, got {text_content!r}")
    specs = {spec.name: spec for spec in select_tools(tools)}
    instructions = system_prompt(tools=list(specs), default_model=inspector.policy.default)
    server: Server = Server(
        SERVER_NAME, version=__version__, instructions=instructions, lifespan=_lifespan(inspector, preload=preload)
    )
    _serve_tools(server, inspector, specs, text_content)
    _serve_prompts(server, list(specs), instructions)
    return server


def _lifespan(inspector: Inspector, *, preload: bool) -> Callable[[Server], AbstractAsyncContextManager[Any]]:
    """The server's lifespan: load the default model (when ``preload``) before the first request is answered."""

    @asynccontextmanager
    async def lifespan(_server: Server) -> AsyncIterator[dict[str, Any]]:
        if preload:
            loaded = await anyio.to_thread.run_sync(inspector.model, None)
            logger.info("loaded %s in %.1f s", loaded.name, loaded.load_seconds)
        yield {"inspector": inspector}

    return lifespan


def _serve_tools(
    server: Server, inspector: Inspector, specs: dict[str, ToolSpec], text_content: TextContentMode
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
        problem = _invalid_unicode_problem(arguments)
        if problem is not None:
            return _error_result(error_text(name, problem))
        try:
            report = await anyio.to_thread.run_sync(partial(spec, inspector, arguments))
        except AttentionToolError as exc:
            return _error_result(error_text(name, exc))
        except Exception as exc:  # a bug: keep serving, log the traceback, tell the client plainly
            logger.exception("tool %s failed on %r", name, arguments)
            return _error_result(f"Internal error in {name}: {type(exc).__name__}: {exc}")
        structured = report.model_dump(mode="json")
        return _text_blocks(concise_text(report), structured, text_content), structured


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


def answerable_line(line: str) -> str:
    """A protocol line the SDK can parse, for a line that is valid JSON holding lone surrogate escapes.

    Strict JSON parsers refuse ``"\\ud800"`` (a lone surrogate), so the SDK would log the line and never answer
    the request: the client would wait forever. A ``tools/call`` gets its arguments replaced by a marker the tool
    answers with an error naming the argument; any other message gets U+FFFD in place of each lone surrogate.
    Other lines pass through unchanged (malformed JSON stays the SDK's to report).
    """
    if not _SURROGATE_ESCAPE.search(line):
        return line
    try:
        message = json.loads(line)
    except ValueError:
        return line
    if not isinstance(message, dict) or _first_invalid_unicode(message, "") is None:
        return line  # surrogate pairs only: valid Unicode
    params = message.get("params")
    if message.get("method") == "tools/call" and isinstance(params, dict):
        problem = _first_invalid_unicode(params.get("arguments"), "")
        if problem is not None:
            params["arguments"] = {INVALID_UNICODE_ARGUMENT: {"message": problem.message, "field": problem.field}}
    return json.dumps(_replace_surrogates(message), ensure_ascii=False)


class _AnswerableLines:
    """The stdin lines the SDK's stdio reader iterates, each passed through :func:`answerable_line`."""

    def __init__(self, lines: Any) -> None:
        self._lines = lines

    async def __aiter__(self) -> AsyncIterator[str]:
        async for line in self._lines:
            yield answerable_line(line)


async def serve_stdio(server: Server, *, stdin: Any = None, stdout: Any = None) -> None:
    """Serve over stdio until the client closes the pipe."""
    import io

    from mcp.server.stdio import stdio_server

    if stdin is None:  # what the SDK would open, wrapped so that every request gets an answer
        stdin = anyio.wrap_file(io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace"))
    # The SDK types stdin as anyio.AsyncFile[str] but only iterates its lines asynchronously, as _AnswerableLines does.
    lines = _AnswerableLines(stdin)
    async with stdio_server(lines, stdout) as (read_stream, write_stream):  # type: ignore[arg-type]
        await server.run(read_stream, write_stream, initialization_options(server))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve_http(server: Server, *, host: str = "127.0.0.1", port: int = 8765, path: str = "/mcp") -> None:
    """Serve over streamable HTTP at ``http://host:port/path``; loopback by default, with DNS-rebinding protection."""
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
    manager = StreamableHTTPSessionManager(app=server, security_settings=security)

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
