"""The stdio front (issue 28: MCP answers at once): ``initialize``, ``ping`` and ``tools/list`` are answered before
the MCP SDK is imported, byte for byte as the SDK server answers them, and every other message reaches the SDK
server in order once it is loaded; every request read before stdin closes is answered before the process ends."""

from __future__ import annotations

import io
import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_tools import __version__
from agent_tools.mcp_front import (
    REPLAYED_ID,
    HandedOff,
    StdioFront,
    checked_initialize,
    handshake_versions,
    server_instructions,
)
from agent_tools.policy import ModelPolicy
from agent_tools.surfaces.mcp_server import build_server, serve_stdio
from agent_tools.tool_declarations import served_names, tool_declarations

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
CLIENT = {"name": "front-test", "version": "1"}
POLICIES = {
    "bundled": ModelPolicy.bundled_only(),
    "extra": ModelPolicy.bundled_only(default="minilm-l6", extra=("./my-model", "org/other")),
    "one": ModelPolicy(frozenset({"minilm-l6"}), "minilm-l6"),
    "any": ModelPolicy(None),
}


def _initialize(request_id: Any, version: str = "2025-06-18", **params: Any) -> dict[str, Any]:
    body = {"protocolVersion": version, "capabilities": {}, "clientInfo": CLIENT, **params}
    return {"jsonrpc": "2.0", "id": request_id, "method": "initialize", "params": body}


def _request(request_id: Any, method: str, params: Any = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": method, **({} if params is None else {"params": params})}


INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}


def _lines(messages: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(m, ensure_ascii=False).encode() + b"\n" for m in messages)


def _by_id(output: bytes) -> dict[Any, bytes]:
    """Answer lines by their request's id (the SDK answers concurrent requests in any order)."""
    answers = {}
    for line in output.splitlines():
        message = json.loads(line)
        if "id" in message and "method" not in message:
            answers[json.dumps(message["id"])] = line
    return answers


class _TextOut:
    """An anyio-style text file collecting what the SDK server writes."""

    def __init__(self) -> None:
        self.buffer = io.StringIO()

    async def write(self, text: str) -> None:
        self.buffer.write(text)

    async def flush(self) -> None:
        pass


def _idle_session() -> Any:
    raise AssertionError("the comparison sends no tool call")


def sdk_answers(messages: list[dict[str, Any]], policy: ModelPolicy, tools: list[str] | None = None) -> bytes:
    """What the SDK server (no front) writes for ``messages`` on stdio."""
    server = build_server(make_inspector=_idle_session, policy=policy, tools=tools, preload=False)
    out = _TextOut()
    anyio.run(lambda: serve_stdio(server, stdin=io.BytesIO(_lines(messages)), stdout=out))
    return out.buffer.getvalue().encode()


def front_answers(
    messages: list[dict[str, Any]], policy: ModelPolicy, tools: list[str] | None = None
) -> tuple[bytes, StdioFront, bool]:
    """What the front writes for ``messages`` followed by the end of stdin, the front, and whether it ended the
    session by itself (everything it read answered: no SDK needed)."""
    read_fd, write_fd = os.pipe()
    written: list[bytes] = []
    drain = threading.Thread(target=lambda: written.append(os.fdopen(read_fd, "rb").read()))  # a pipe holds 64 KB
    drain.start()
    done = threading.Event()
    front = StdioFront(served_names(tools), policy, server_version=__version__, output=write_fd, on_done=done.set)
    front.start(io.BytesIO(_lines(messages)))
    assert front.stdin_ended.wait(30)
    finished = done.wait(5) if front.handoff() is None else False  # the handoff stops the front's answers
    os.close(write_fd)
    drain.join(30)
    return written[0], front, finished


# --- the front's answers are the SDK's, byte for byte --------------------------------------------------------------
VERSIONS = ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28", "1999-01-01", ""]


@pytest.mark.parametrize("version", VERSIONS)
def test_initialize_negotiates_as_the_sdk(version: str) -> None:
    """Every protocol version a client may ask for, the SDK's own and others: the same answer, byte for byte."""
    capabilities = {"roots": {"listChanged": True}, "sampling": {}, "elicitation": {"form": {}}}
    messages = [_initialize(7, version, capabilities=capabilities), INITIALIZED, _request(8, "ping")]
    front, _, finished = front_answers(messages, POLICIES["bundled"])
    assert finished
    assert front.splitlines() == [_by_id(sdk_answers(messages, POLICIES["bundled"]))[k] for k in ("7", "8")]
    negotiated = json.loads(front.splitlines()[0])["result"]["protocolVersion"]
    accepted = handshake_versions()
    assert accepted is not None
    assert negotiated == (version if version in accepted[0] else accepted[1])


@pytest.mark.parametrize("name", list(POLICIES))
def test_tools_list_is_the_sdks_for_every_policy(name: str) -> None:
    messages = [
        _initialize("a", "2025-11-25", clientInfo={**CLIENT, "title": "T é"}),
        INITIALIZED,
        _request("ü\n\"id'", "tools/list"),
        _request(2**40, "tools/list", {"cursor": "next"}),
        _request(-3, "tools/list", {}),
        _request(0, "ping", {}),
    ]
    front, state, finished = front_answers(messages, POLICIES[name])
    assert finished and state.answered == ["initialize", "tools/list", "tools/list", "tools/list", "ping"]
    sdk = _by_id(sdk_answers(messages, POLICIES[name]))
    assert _by_id(front) == sdk and len(sdk) == 5


def test_a_tool_selection_lists_the_same_tools_as_the_sdk() -> None:
    tools = ["show_attention", "describe_model", "corpus_summary"]
    messages = [_initialize(1), _request(2, "tools/list")]
    front, _, _ = front_answers(messages, POLICIES["bundled"], tools)
    assert _by_id(front) == _by_id(sdk_answers(messages, POLICIES["bundled"], tools))
    listed = [tool["name"] for tool in json.loads(front.splitlines()[1])["result"]["tools"]]
    assert listed == ["describe_model", "show_attention", "corpus_summary"]  # the declaration order


def test_the_instructions_are_the_prompt_file_with_the_tools_served() -> None:
    text = server_instructions(["show_attention", "describe_model"], ModelPolicy.bundled_only("minilm-l6"))
    assert "`show_attention`, `describe_model`" in text
    assert "`model`: `minilm-l6` (default) or `smollm2-135m-instruct`." in text  # the session's allow-list
    assert "{tools}" not in text and "{models}" not in text


# --- what the front leaves to the SDK ----------------------------------------------------------------------------
HELD_INITIALIZE = {
    "a number as version": {"protocolVersion": 5, "capabilities": {}, "clientInfo": CLIENT},
    "no client info": {"protocolVersion": "2025-06-18", "capabilities": {}},
    "a client icon": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {**CLIENT, "icons": []}},
    "tasks capability": {"protocolVersion": "2025-06-18", "capabilities": {"tasks": {}}, "clientInfo": CLIENT},
    "roots as a string": {"protocolVersion": "2025-06-18", "capabilities": {"roots": "yes"}, "clientInfo": CLIENT},
    "sampling details": {
        "protocolVersion": "2025-06-18",
        "capabilities": {"sampling": {"context": {"x": 1}}},
        "clientInfo": CLIENT,
    },
    "a progress token": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": CLIENT, "_meta": {}},
}


@pytest.mark.parametrize("case", list(HELD_INITIALIZE))
def test_an_initialize_the_front_cannot_check_goes_to_the_sdk(case: str) -> None:
    params = HELD_INITIALIZE[case]
    assert checked_initialize(params) is None
    messages = [{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}, _request(2, "tools/list")]
    written, front, finished = front_answers(messages, POLICIES["bundled"])
    assert written == b"" and front.answered == [] and not finished  # held: the SDK answers both


def test_requests_before_initialize_and_other_methods_go_to_the_sdk() -> None:
    written, front, finished = front_answers([_request(1, "tools/list"), _initialize(2)], POLICIES["bundled"])
    assert written == b"" and not finished  # tools/list first decides the SDK's protocol era: it answers all
    messages = [
        _initialize(1),
        _request(2, "prompts/list"),
        _request(3, "tools/call", {"name": "describe_model", "arguments": {}}),
        _request(4, "tools/list", {"_meta": {"progressToken": 1}}),
        _request(5, "tools/list"),
        _initialize(6),  # a second initialize: from here the SDK answers everything
        _request(7, "tools/list"),
    ]
    written, front, finished = front_answers(messages, POLICIES["bundled"])
    assert not finished and front.answered == ["initialize", "tools/list"]
    assert [json.loads(line)["id"] for line in written.splitlines()] == [1, 5]


def test_the_handoff_replays_initialize_where_the_client_sent_it() -> None:
    """The SDK server's stdin: what the front did not answer, in order, with the initialize under a private id."""
    read_fd, write_fd = os.pipe()
    stdin_r, stdin_w = os.pipe()
    front = StdioFront(["describe_model"], POLICIES["bundled"], server_version="0", output=write_fd, on_done=print)
    notice = {"jsonrpc": "2.0", "method": "notifications/roots/list_changed"}
    call = _request(3, "tools/call", {"name": "describe_model", "arguments": {}})
    os.write(stdin_w, _lines([notice, _initialize(1), INITIALIZED, _request(2, "tools/list"), call]))
    front.start(os.fdopen(stdin_r, "rb"))
    with os.fdopen(read_fd, "rb") as answers:
        assert [json.loads(answers.readline())["id"] for _ in range(2)] == [1, 2]
        stdin = front.handoff()
        assert isinstance(stdin, HandedOff)
        os.write(stdin_w, _lines([_request(4, "ping")]))
        os.close(stdin_w)
        lines = []
        while line := stdin.readline():
            lines.append(json.loads(line))
        os.close(write_fd)
        assert answers.read() == b""  # nothing written by the front after the handoff
    assert lines == [notice, {**_initialize(1), "id": REPLAYED_ID}, INITIALIZED, call, _request(4, "ping")]


# --- a server process whose MCP SDK cannot be imported until the test says so ---------------------------------------
SHIM = textwrap.dedent(
    """
    # A stand-in for the MCP SDK: importing it blocks until the release file exists, then it becomes the real one.
    import importlib, os, sys, time

    open(os.environ["MCP_SHIM_ENTERED"], "w").close()
    while not os.path.exists(os.environ["MCP_SHIM_RELEASE"]):
        time.sleep(0.02)
    shim = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != shim]
    del sys.modules["mcp"]
    sys.modules["mcp"] = importlib.import_module("mcp")  # the import statement returns what sys.modules holds
    """
)


@contextmanager
def gated_server(tmp_path: Path, *options: str) -> Iterator[tuple[subprocess.Popen[bytes], queue.Queue[Any], Path]]:
    """The ``mcp`` command with a shim ``mcp`` package first on its path; yields the process, its stdout lines (a
    queue; None at the end) and the release file."""
    (tmp_path / "shim" / "mcp").mkdir(parents=True)
    (tmp_path / "shim" / "mcp" / "__init__.py").write_text(SHIM)
    release = tmp_path / "release"
    env = {
        **ENV,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "shim"), str(ROOT)]),
        "MCP_SHIM_ENTERED": str(tmp_path / "entered"),
        "MCP_SHIM_RELEASE": str(release),
    }
    command = [sys.executable, "-m", "agent_tools.cli", "--artifacts", str(tmp_path), "mcp", *options]
    with (tmp_path / "server.log").open("w") as log:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
    lines: queue.Queue[Any] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(json.loads(line))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        yield process, lines, release
    finally:
        release.touch()
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def _next(lines: queue.Queue[Any]) -> Any:
    return lines.get(timeout=300)  # a liveness bound for a loaded machine, not a speed claim


def _send(process: subprocess.Popen[bytes], *messages: dict[str, Any]) -> None:
    assert process.stdin is not None
    process.stdin.write(_lines(list(messages)))
    process.stdin.flush()


@pytest.mark.slow
def test_initialize_and_tools_list_are_answered_while_the_sdk_cannot_load(tmp_path: Path) -> None:
    """While importing ``mcp`` blocks, the process answers initialize, tools/list and ping (the front); once it is
    released, prompts/get and a tools/call sent meanwhile are answered by the real SDK, in the same session."""
    with gated_server(tmp_path, "--no-preload") as (process, lines, release):
        _send(process, _initialize(1), INITIALIZED, _request(2, "tools/list"), _request(3, "ping"))
        _send(process, _request(4, "prompts/get", {"name": "attention_explainer"}))
        _send(process, _request(5, "tools/call", {"name": "no_such_tool", "arguments": {}}))
        answers = [_next(lines) for _ in range(3)]
        assert [a["id"] for a in answers] == [1, 2, 3] and not release.exists()
        deadline = time.monotonic() + 300  # a liveness bound: the main thread reaches the blocked SDK import
        while not (tmp_path / "entered").exists():
            assert time.monotonic() < deadline and process.poll() is None, "the server never imported mcp"
            time.sleep(0.05)
        assert answers[0]["result"]["serverInfo"]["name"] == "attention-explainer"
        assert len(answers[1]["result"]["tools"]) == len(tool_declarations()) and answers[2]["result"] == {}
        assert lines.empty()  # the prompt and the call wait for the SDK
        release.touch()
        later = {a["id"]: a for a in (_next(lines), _next(lines))}
        assert later[4]["result"]["messages"][0]["content"]["text"].startswith("You are an attention explainer.")
        unknown = later[5]["result"]
        assert unknown["isError"] and "unknown tool 'no_such_tool'" in unknown["content"][0]["text"]
        _send(process, _request(6, "tools/list"))  # now the SDK's own answer
        assert _next(lines) == answers[1] | {"id": 6}
        assert process.stdin is not None
        process.stdin.close()
        assert _next(lines) is None and process.wait(timeout=60) == 0
    log = (tmp_path / "server.log").read_text()
    assert "answered initialize, tools/list, ping before the MCP SDK loaded" in log
    assert "Traceback" not in log and "replayed initialize" not in log


@pytest.mark.slow
def test_a_client_that_closes_stdin_after_tools_list_gets_every_answer_without_the_sdk(tmp_path: Path) -> None:
    """The issue's client: initialize and tools/list, then stdin closed at once. It got only the initialize answer;
    now both come, and the process ends by itself while the SDK's import is still blocked (never released)."""
    with gated_server(tmp_path, "--no-preload") as (process, lines, release):
        _send(process, _initialize(1), INITIALIZED, _request(2, "tools/list"))
        assert process.stdin is not None
        process.stdin.close()
        assert process.wait(timeout=120) == 0 and not release.exists()
        assert [_next(lines)["id"], _next(lines)["id"], _next(lines)] == [1, 2, None]


@pytest.mark.slow
def test_requests_read_before_stdin_closed_are_answered_through_the_sdk(tmp_path: Path) -> None:
    """Requests the SDK must answer, then stdin closed at once: each is answered before the process ends — a
    prompt, an unknown tool, and a call waiting for the tools to load (stopped: the client is gone)."""
    command = [sys.executable, "-m", "agent_tools.cli", "--artifacts", str(tmp_path), "mcp", "--no-preload"]
    messages = [
        _initialize(1),
        INITIALIZED,
        _request(2, "tools/list"),
        _request(3, "prompts/get", {"name": "attention_explainer"}),
        _request(4, "tools/call", {"name": "no_such_tool", "arguments": {}}),
        _request(5, "tools/call", {"name": "describe_model", "arguments": {}}),
    ]
    done = subprocess.run(command, input=_lines(messages), capture_output=True, env=ENV, timeout=300, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    answers = {a["id"]: a for a in map(json.loads, done.stdout.splitlines())}
    assert sorted(answers) == [1, 2, 3, 4, 5]
    assert answers[3]["result"]["messages"] and answers[4]["result"]["isError"]
    stopped = answers[5]["result"]
    assert stopped["isError"] and stopped["content"][0]["text"].startswith("Error [cancelled]"), stopped
    assert "the client closed the connection" in stopped["content"][0]["text"]


def test_the_front_stops_reading_when_it_holds_too_much(monkeypatch) -> None:
    """Past ``MAX_HELD_BYTES`` held for the SDK server, the front reads no further until the handoff (a client
    sending faster than the SDK loads waits, as it would with the SDK's reader); nothing is lost or reordered."""
    import agent_tools.mcp_front as front_module

    monkeypatch.setattr(front_module, "MAX_HELD_BYTES", 1)
    read_fd, write_fd = os.pipe()
    front = StdioFront(["describe_model"], POLICIES["bundled"], server_version="0", output=write_fd, on_done=print)
    prompts = [_request(i, "prompts/list") for i in range(2, 7)]
    front.start(io.BytesIO(_lines([_initialize(1), *prompts])))
    with os.fdopen(read_fd, "rb") as answers:
        assert json.loads(answers.readline())["id"] == 1
        assert not front.stdin_ended.wait(0.5)  # it holds the first prompts/list and waits
        stdin = front.handoff()
        assert stdin is not None
        lines = [json.loads(line) for line in iter(stdin.readline, b"")]
        os.close(write_fd)
    assert lines == [{**_initialize(1), "id": REPLAYED_ID}, *prompts]
