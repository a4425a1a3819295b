"""The MCP server's stdio front: its first answers, with the standard library only, while the SDK loads.

The MCP SDK takes 1.5 to 2.4 s of CPU to import (the pydantic models of both protocol eras), the tools seconds more
(torch); clients give up on ``initialize`` after 10 to 60 s and show no tool until ``tools/list``. So the ``mcp``
command starts this front first: a thread reads stdin at once and answers ``initialize``, ``ping`` and
``tools/list`` from the tools' declaration data (:mod:`agent_tools.tool_declarations`) and
``prompts/mcp_instructions.md`` — byte for byte what the SDK server answers, protocol-version negotiation included
(``tests/test_mcp_front.py`` compares them) — and holds every other message, in order, for the SDK server.

When the SDK is imported and the server built, :meth:`StdioFront.handoff` gives that server a stdin of its own: the
client's ``initialize`` again, where the client sent it but under a private id (:data:`REPLAYED_ID`, whose answer
the server drops), so the SDK's session is in the state the client set up; then every message the front did not
answer; then the rest of stdin. A client that closes stdin once the front has answered all it asked ends the
process without the SDK being imported.

What the front answers is deliberately narrow: a handshake-era ``initialize`` whose parameters it can check without
pydantic (a client info of strings, the usual capabilities); then ``ping`` and ``tools/list``. Anything else —
``prompts/*`` (their templates need LangChain), a malformed line, an ``initialize`` it cannot check, every message
of a client that does not open with ``initialize`` (the 2026-07-28 protocol) — goes to the SDK, which answers it
as it would have: later, never differently.

Also here because the front needs them and must not import the SDK: the server's name, its instructions
(:func:`server_instructions`), its ``tools/list`` (:func:`tool_listing`, which the SDK server lists too), the
line limits the stdio transport enforces, and the JSON-RPC checks (:func:`read_message`, :class:`RpcProblem`)
the SDK server completes with those that need the SDK (unknown methods, parameters) for stdio lines and HTTP bodies.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from functools import cache
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from agent_tools.policy import ModelPolicy
from agent_tools.prompts import INSTRUCTIONS_FILE, read_prompt_file, render_tool_mentions
from agent_tools.tool_declarations import agent_schema, model_choices, tool_declarations

logger = logging.getLogger(__name__)

SERVER_NAME = "attention-explainer"
# Every tool only reads its inputs and writes at most a new file in the session's folder.
TOOL_ANNOTATIONS: dict[str, bool] = {"destructiveHint": False, "idempotentHint": True, "openWorldHint": False}
# What the SDK's server advertises for the handlers it has (tools and prompts, lists that never change).
CAPABILITIES: dict[str, Any] = {"prompts": {"listChanged": False}, "tools": {"listChanged": False}}
MAX_LINE_BYTES = 16 << 20  # one stdio message; a longer line is refused and skipped
MAX_JSON_DEPTH = 64  # nesting of one message; MCP messages need about 8
MAX_HELD_BYTES = 4 * MAX_LINE_BYTES  # the front reads no further while it holds this much for the SDK server
# The id under which the client's ``initialize`` is replayed to the SDK server (which must not answer it twice).
REPLAYED_ID = "attention-explainer/stdio-front/initialize"
# The fields the SDK's 2025-11-25 wire model of a tool's input and output schema declares, in its order: it
# writes them first, then the schema's other keys in their order, and leaves out null values.
_SCHEMA_FIELDS = ("$schema", "properties", "required", "type")
_CLIENT_INFO_FIELDS = frozenset({"name", "version", "title", "description", "websiteUrl"})
_EMPTY_CAPABILITY_FIELDS = {"sampling": frozenset({"context", "tools"}), "elicitation": frozenset({"form", "url"})}
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # lone surrogates are the SDK path's to answer
_REPLAY = b""  # the place of the client's initialize among the held lines (no real line is empty)
_ABSENT = object()
_MAX_EXACT_INT = 2**53  # ids beyond it are left to the SDK
# JSON-RPC's error codes (as the SDK's ``types`` names them; here without importing it)
PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602


def exit_flushed(code: int, streams: Iterable[Any]) -> NoReturn:
    """Flush ``streams`` (passing over those that are gone or closed) and end the process now with ``code``."""
    for stream in streams:
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def server_instructions(tools: list[str], policy: ModelPolicy) -> str:
    """The server's instructions: how to use the tools served, in a few lines (``prompts/mcp_instructions.md``).

    The full system prompt (the tool catalogue and the reasoning rules) stays one ``prompts/get`` away, as the
    ``attention_explainer`` prompt; the tool descriptions are in ``tools/list`` already.
    """
    template = render_tool_mentions(read_prompt_file(INSTRUCTIONS_FILE).template, tools)
    listed = ", ".join(f"`{name}`" for name in tools)
    return template.replace("{tools}", listed).replace("{models}", model_choices(policy))


def valid_id(value: Any) -> bool:
    """A JSON-RPC request id: a string or an integer (not a boolean)."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _nodes(value: Any) -> Iterator[tuple[Any, int]]:
    """Every value inside a decoded JSON ``value``, itself included, with its depth (iterative: deep input costs
    no recursion)."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        yield item, depth
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        pending.extend((child, depth + 1) for child in children)


def deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than ``limit`` levels."""
    return any(depth > limit and isinstance(item, dict | list) and item for item, depth in _nodes(value))


@cache
def handshake_versions() -> tuple[tuple[str, ...], str] | None:
    """The protocol versions the installed SDK accepts in ``initialize`` and the one it offers otherwise (its
    latest), or None when they cannot be read (the front then leaves ``initialize`` to the SDK).

    Read from ``mcp_types/version.py`` as a file: importing the ``mcp_types`` package imports every model (0.7 s).
    """
    try:
        spec = importlib.util.find_spec("mcp_types")  # a top-level package is found, not imported
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            path = Path(folder) / "version.py"
            loader_spec = importlib.util.spec_from_file_location("_attention_explainer_mcp_versions", path)
            if not path.is_file() or loader_spec is None or loader_spec.loader is None:
                continue
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
            versions, latest = tuple(module.HANDSHAKE_PROTOCOL_VERSIONS), module.LATEST_HANDSHAKE_VERSION
            if versions and all(isinstance(v, str) for v in versions) and latest in versions:
                return versions, latest
    except Exception:  # another SDK layout: the SDK answers initialize itself, a little later
        logger.warning("the MCP SDK's protocol versions could not be read; initialize waits for the SDK")
    return None


def wire_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's input or output schema as the SDK writes it in ``tools/list`` (see ``_SCHEMA_FIELDS``)."""
    written = {key: schema[key] for key in _SCHEMA_FIELDS if schema.get(key) is not None}
    written.update((key, value) for key, value in schema.items() if key not in written and value is not None)
    return written


def tool_listing(names: Iterable[str], policy: ModelPolicy) -> dict[str, Any]:
    """The ``tools/list`` result for the tools served under ``policy``, as the SDK server writes it (and lists it).
    No title: clients show the name (18 titles were 540 bytes of ``tools/list``)."""
    declared = tool_declarations()
    tools = [
        {
            "annotations": dict(TOOL_ANNOTATIONS),
            "description": declared[name]["description"],
            "inputSchema": wire_schema(agent_schema(declared[name], policy)),
            "name": name,
            "outputSchema": wire_schema(declared[name]["output_schema"]),
        }
        for name in names
    ]
    return {"tools": tools}


def _plain_json(value: Any) -> bool:
    """Whether the standard library writes every number of ``value`` as the SDK (pydantic) does: floats without
    an exponent, no NaN or infinity (pydantic writes 1e-05 as 0.00001)."""
    return not any(isinstance(item, float) and any(c in repr(item) for c in "eEn") for item, _ in _nodes(value))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def checked_initialize(params: Any) -> str | None:
    """The protocol version an ``initialize`` asks for, when its parameters are ones the SDK accepts as they are
    (checked without pydantic, so more narrowly than the SDK checks); else None: the SDK answers it."""
    if not isinstance(params, dict) or not set(params) <= {"protocolVersion", "capabilities", "clientInfo"}:
        return None
    requested, info, capabilities = params.get("protocolVersion"), params.get("clientInfo"), params.get("capabilities")
    if not isinstance(requested, str) or not isinstance(info, dict) or not isinstance(capabilities, dict):
        return None
    if not {"name", "version"} <= set(info) <= _CLIENT_INFO_FIELDS:
        return None
    if not all(isinstance(v, str) for v in info.values()):
        return None
    for name, value in capabilities.items():
        if not isinstance(value, dict):
            return None
        if name == "experimental":
            fits = all(isinstance(v, dict) for v in value.values())
        elif name == "roots":
            fits = set(value) <= {"listChanged"} and all(isinstance(v, bool) for v in value.values())
        elif name in _EMPTY_CAPABILITY_FIELDS:
            fits = set(value) <= _EMPTY_CAPABILITY_FIELDS[name] and all(v == {} for v in value.values())
        else:
            fits = False
        if not fits:
            return None
    return requested


class RpcProblem(Exception):
    """A line that gets a JSON-RPC error answer from this server instead of reaching the SDK (which would drop it)."""

    def __init__(self, code: int, message: str, request_id: str | int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id

    def answer(self) -> str:
        """The error response line (``id`` null when the request's id could not be read, as JSON-RPC says)."""
        error = {"code": self.code, "message": self.message}
        return json.dumps({"jsonrpc": "2.0", "id": self.request_id, "error": error}, ensure_ascii=False)


def _lenient_id(raw: bytes) -> str | int | None:
    """The id of a line that is JSON once its bad bytes are replaced, so the client's request still gets an
    answer (an error: the replaced text itself is never analysed)."""
    try:
        value = json.loads(raw.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return None
    request_id = value.get("id") if isinstance(value, dict) else None
    return request_id if valid_id(request_id) else None


def read_message(raw: bytes) -> dict[str, Any] | None:
    """The single JSON-RPC 2.0 message one line (or HTTP body) holds, as far as it can be checked without the SDK;
    None for a blank line.

    Raises :class:`RpcProblem` for what gets an error answer: not UTF-8 or not JSON (-32700); over
    ``MAX_LINE_BYTES``, a batch, not an object, an id that is not a string or an integer, no ``"jsonrpc": "2.0"``,
    nesting deeper than ``MAX_JSON_DEPTH``, a method that is not a string or ``params`` that are not an object
    (-32600).
    """
    if len(raw) > MAX_LINE_BYTES:
        raise RpcProblem(INVALID_REQUEST, f"Invalid Request: a message over {MAX_LINE_BYTES:,} bytes")
    if not raw.strip():
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        msg = f"Parse error: the message is not valid UTF-8 (byte {exc.start}); send UTF-8 JSON"
        raise RpcProblem(PARSE_ERROR, msg, _lenient_id(raw)) from exc
    try:
        value = json.loads(text)
    except RecursionError as exc:
        msg = f"Parse error: nested too deeply to parse; at most {MAX_JSON_DEPTH} levels are accepted"
        raise RpcProblem(PARSE_ERROR, msg) from exc
    except ValueError as exc:
        raise RpcProblem(PARSE_ERROR, f"Parse error: not valid JSON ({exc})") from exc
    if isinstance(value, list):
        raise RpcProblem(INVALID_REQUEST, "Invalid Request: batches are not supported; send one message a line")
    if not isinstance(value, dict):
        raise RpcProblem(INVALID_REQUEST, "Invalid Request: a message must be a JSON object")
    request_id = value.get("id")
    answer_id = request_id if valid_id(request_id) else None
    if "id" in value and answer_id is None:
        raise RpcProblem(INVALID_REQUEST, "Invalid Request: id must be a string or an integer")
    if value.get("jsonrpc") != "2.0":
        raise RpcProblem(INVALID_REQUEST, 'Invalid Request: "jsonrpc" must be "2.0"', answer_id)
    if deeper_than(value, MAX_JSON_DEPTH):
        raise RpcProblem(INVALID_REQUEST, f"Invalid Request: nested deeper than {MAX_JSON_DEPTH} levels", answer_id)
    if "method" in value:
        if not isinstance(value["method"], str):
            raise RpcProblem(INVALID_REQUEST, "Invalid Request: method must be a string", answer_id)
        if value.get("params") is not None and not isinstance(value["params"], dict):
            raise RpcProblem(INVALID_REQUEST, "Invalid Request: params must be an object", answer_id)
    return value


def plain_request(raw: bytes) -> tuple[str | int, str, Any] | None:
    """``(id, method, params)`` of a line holding one well-formed JSON-RPC request (``params`` is ``_ABSENT`` when
    the line has none); None for anything else (a notification, a response, a malformed line)."""
    if _SURROGATE_ESCAPE.search(raw):
        return None
    try:
        value = read_message(raw)
    except RpcProblem:
        return None
    if value is None or "id" not in value or "method" not in value:
        return None
    request_id, params = value["id"], value.get("params", _ABSENT)
    if not set(value) <= {"jsonrpc", "id", "method", "params"} or params is None:
        return None
    if isinstance(request_id, int) and abs(request_id) > _MAX_EXACT_INT:
        return None
    return request_id, value["method"], params


def needs_answer(raw: bytes) -> bool:
    """Whether a line the front held may need an answer (all but blank lines and well-formed notifications)."""
    if not raw.strip():
        return False
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return True
    return not (isinstance(value, dict) and isinstance(value.get("method"), str) and "id" not in value)


class HandedOff:
    """The SDK server's stdin after the handoff: the held lines, then stdin's (``readline`` as a binary file's;
    ``b""`` at the end)."""

    def __init__(self, held: list[bytes], lines: queue.Queue[bytes]) -> None:
        self._held = collections.deque(held)
        self._lines = lines
        self._ended = False

    def readline(self, size: int = -1) -> bytes:
        del size  # the front reads stdin in chunks of the SDK side's size
        if self._ended:
            return b""
        line = self._held.popleft() if self._held else self._lines.get()
        self._ended = not line
        return line


class StdioFront:
    """Answers the first messages of a stdio MCP session until :meth:`handoff` (see the module docstring).

    Args:
        names: the tools served; ``policy``: the session's allow-list (the ``model`` enum of ``tools/list``).
        server_version: the ``serverInfo`` version (the package's).
        output: the protocol's file descriptor (the front writes whole lines to it, then never again once handed
            off).
        on_done: called from the reader thread when stdin ends and the front answered every request it read
            (nothing is held that needs an answer): the process can end without the SDK.
    """

    def __init__(
        self,
        names: list[str],
        policy: ModelPolicy,
        *,
        server_version: str,
        output: int,
        on_done: Callable[[], None],
    ) -> None:
        self.names, self.policy, self.server_version = names, policy, server_version
        self.output, self.on_done = output, on_done
        self.answered: list[str] = []  # the methods answered here, in order (for the log and the tests)
        self._lock = threading.Lock()
        # After the handoff, stdin's lines for the SDK server: a few at a time, so a client sending faster than
        # the server reads waits, as it would with the SDK's own reader.
        self._feed: queue.Queue[bytes] = queue.Queue(maxsize=8)
        self._held: list[bytes] = []  # for the SDK server, in order, until the handoff; _REPLAY: the initialize
        self._held_bytes = 0
        self._resumed = threading.Event()  # set at the handoff (the reader waits for it when it holds too much)
        self._initialize: dict[str, Any] | None = None  # the params of the client's initialize answered here
        self._answering = True
        self._handed_off = self._finished = False
        self.stdin_ended = threading.Event()  # set once the reader met the end of stdin (and held what it read)
        self._listing: str | None = None

    def start(self, stdin: BinaryIO) -> None:
        threading.Thread(target=self._read, args=(stdin,), name="mcp-stdio-front", daemon=True).start()

    def handoff(self) -> HandedOff | None:
        """Stop answering: the SDK server reads the rest through the returned stdin (None when the session already
        ended with everything answered: there is nothing left to serve)."""
        with self._lock:
            if self._finished:
                return None
            self._handed_off = True
            held = [self._replayed_initialize() if line is _REPLAY else line for line in self._held]
            if self.stdin_ended.is_set():
                held.append(b"")
            self._held.clear()
            self._resumed.set()
        if self.answered:
            logger.info("answered %s before the MCP SDK loaded", ", ".join(self.answered))
        return HandedOff(held, self._feed)

    def _replayed_initialize(self) -> bytes:
        message = {"jsonrpc": "2.0", "id": REPLAYED_ID, "method": "initialize", "params": self._initialize}
        return (_dumps(message) + "\n").encode()

    def _read(self, stdin: BinaryIO) -> None:
        skipping = False  # inside a line over MAX_LINE_BYTES: its chunks go to the SDK side, which refuses it
        while True:
            try:
                raw = stdin.readline(MAX_LINE_BYTES + 1)
            except (OSError, ValueError):  # stdin broken or closed under us: the client is gone as well
                raw = b""
            with self._lock:
                forward = self._handed_off
                if not forward and not raw:
                    self.stdin_ended.set()
                    self._finished = not any(line is not _REPLAY and needs_answer(line) for line in self._held)
                    break
                if not forward:
                    answer = None
                    if skipping or len(raw) > MAX_LINE_BYTES:
                        skipping = not raw.endswith(b"\n")
                    else:
                        answer = self._answer(raw)
                    if answer is None:
                        self._held.append(raw)
                        self._held_bytes += len(raw)
                    elif not self._write(answer):
                        self._answering = False
            if forward:
                self._feed.put(raw)  # outside the lock: it waits while the SDK side is behind
                if not raw:
                    return
            elif self._held_bytes > MAX_HELD_BYTES:
                self._resumed.wait()  # the SDK server reads the rest
        if self._finished:
            self.on_done()

    def _answer(self, raw: bytes) -> str | None:
        """The answer line to ``raw`` when the front gives it, else None (the line is held for the SDK)."""
        if not self._answering:
            return None
        request = plain_request(raw)
        if request is None:
            if self._initialize is None and needs_answer(raw):
                self._answering = False  # a request before initialize decides the SDK's protocol era
            return None
        request_id, method, params = request
        result: str | None = None
        if method == "initialize" and self._initialize is None:
            result = self._initialize_result(params)
            if result is not None:
                self._initialize = params
                self._held.append(_REPLAY)  # the SDK server sees it where the client sent it
        elif self._initialize is not None and method == "ping" and params in (_ABSENT, {}):
            result = "{}"
        elif self._initialize is not None and method == "tools/list" and _first_page(params):
            result = self._tool_listing()
        if result is None:
            if self._initialize is None or method == "initialize":
                self._answering = False  # the SDK's session state may change: it answers everything from here
            return None
        self.answered.append(method)
        return '{"jsonrpc":"2.0","id":' + _dumps(request_id) + ',"result":' + result + "}"

    def _initialize_result(self, params: Any) -> str | None:
        requested = checked_initialize(params)
        versions = handshake_versions()
        if requested is None or versions is None:
            return None
        accepted, latest = versions
        result = {  # as the SDK server writes it: its wire model's fields in their order
            "capabilities": CAPABILITIES,
            "instructions": server_instructions(self.names, self.policy),
            "protocolVersion": requested if requested in accepted else latest,
            "serverInfo": {"name": SERVER_NAME, "version": self.server_version},
        }
        return _dumps(result)

    def _tool_listing(self) -> str | None:
        if self._listing is None:
            listing = tool_listing(self.names, self.policy)
            self._listing = _dumps(listing) if _plain_json(listing) else ""
        return self._listing or None

    def _write(self, line: str) -> bool:
        """Write one answer line whole; False when the client's end is closed."""
        view = memoryview((line + "\n").encode())
        try:
            while view:
                view = view[os.write(self.output, view) :]
        except OSError:
            return False
        return True


def _first_page(params: Any) -> bool:
    """A ``tools/list`` request the front answers: no parameters, or a cursor (the list is one page)."""
    if params is _ABSENT or params == {}:
        return True
    return isinstance(params, dict) and set(params) == {"cursor"} and isinstance(params["cursor"], str)
