"""The MCP server in a separate process, driven by the official MCP Python client over stdio.

One server process serves the whole module (it loads the default model once, at start-up): list the tools,
check every input and output schema, call every tool with its declared example, validate the structured
content with the project's own models, trigger errors, read the prompts, and load the tools into a LangChain
agent with langchain-mcp-adapters. A second, short-lived server checks the streamable HTTP transport.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp_process import ENV, ROOT, server_command
from scripted_chat import (
    ScriptedChatModel,
    all_tool_messages,
    answer,
    ask,
    call,
    new_tool_messages,
    text_of,
    valid_range,
)

from agent_tools.cli import build_parser
from agent_tools.loading import BUNDLED_MODELS, ModelPolicy
from agent_tools.prompts import TOPICS
from agent_tools.surfaces import agent_input_model
from agent_tools.surfaces.mcp_server import output_schema
from agent_tools.tools import TOOLS, get_tool

pytestmark = pytest.mark.real_model

SHOW = get_tool("show_attention")


@dataclass
class Transcript:
    """Everything the client saw during one session with the server."""

    init: types.InitializeResult
    tools: list[types.Tool]
    results: dict[str, types.CallToolResult]
    errors: dict[str, types.CallToolResult]
    prompts: list[types.Prompt]
    prompt: types.GetPromptResult
    agent: dict[str, Any] = field(default_factory=dict)
    log: str = ""


async def drive(command: list[str], log_path: Path) -> Transcript:
    from langchain_mcp_adapters.tools import load_mcp_tools

    params = StdioServerParameters(command=command[0], args=command[1:], env=ENV, cwd=str(ROOT))
    with log_path.open("w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
            init = await session.initialize()
            tools = (await session.list_tools()).tools
            results = {tool.name: await session.call_tool(tool.name, TOOLS[tool.name].example) for tool in tools}
            bad = {
                "layer": {**SHOW.example, "layer": 99},
                "model": {**SHOW.example, "model": "/etc/passwd"},
                "type": {**SHOW.example, "head": "zero"},
                "extra": {**SHOW.example, "path": "/etc/passwd"},
                "empty": {**SHOW.example, "text": ""},
            }
            errors = {label: await session.call_tool("show_attention", args) for label, args in bad.items()}
            errors["unknown_tool"] = await session.call_tool("no_such_tool", {})
            prompts = (await session.list_prompts()).prompts
            prompt = await session.get_prompt("explain_collapse", {"text": "The cat sat on the mat."})
            transcript = Transcript(init, tools, results, errors, prompts, prompt)
            transcript.agent = await run_agents(await load_mcp_tools(session))
    transcript.log = log_path.read_text()
    return transcript


async def run_agents(lc_tools: list) -> dict[str, Any]:
    """Two agent runs over the MCP tools (via langchain-mcp-adapters); the policies read what they receive."""
    seen: dict[str, Any] = {"tool_names": [t.name for t in lc_tools]}

    def correct(messages, bound):
        received = new_tool_messages(messages)
        if not received:
            return ask(call("show_attention", **SHOW.example))
        message = received[0]
        structured = message.artifact["structured_content"]
        seen["correct_message"] = message
        return answer(f"Layer {structured['layer']}: mean entropy {structured['mean_entropy']} nats.")

    def corrected(messages, bound):
        received = new_tool_messages(messages)
        if not received:
            return ask(call("show_attention", **{**SHOW.example, "layer": 99}))
        message = received[0]
        if message.status == "error":
            _, high = valid_range(text_of(message), "layer")
            return ask(call("show_attention", **{**SHOW.example, "layer": high}))
        return answer(f"Layer {message.artifact['structured_content']['layer']} done.")

    for name, policy in (("correct", correct), ("corrected", corrected)):
        agent = create_agent(ScriptedChatModel(policy=policy), lc_tools)
        seen[name] = await agent.ainvoke({"messages": [("user", "What does layer 3 head 0 read?")]})
    return seen


@pytest.fixture(scope="module")
def transcript(tmp_path_factory) -> Transcript:
    folder = tmp_path_factory.mktemp("mcp")
    command = server_command(artifacts=folder / "artifacts")
    return anyio.run(drive, command, folder / "server.log")


# --- listing and schemas -----------------------------------------------------------------------------------
def test_initialize_and_instructions(transcript) -> None:
    assert transcript.init.serverInfo.name == "attention-explainer"
    assert transcript.init.capabilities.tools is not None and transcript.init.capabilities.prompts is not None
    for name in TOOLS:  # the system prompt, generated from the declarations
        assert f"`{name}`" in transcript.init.instructions


def test_lists_every_declared_tool(transcript) -> None:
    assert [tool.name for tool in transcript.tools] == list(TOOLS)


@pytest.mark.parametrize("name", list(TOOLS))
def test_input_and_output_schemas(transcript, name) -> None:
    spec = TOOLS[name]
    tool = next(t for t in transcript.tools if t.name == name)
    assert tool.description == spec.description
    assert tool.inputSchema == agent_input_model(spec, ModelPolicy.bundled_only()).model_json_schema()
    assert tool.inputSchema["type"] == "object" and tool.inputSchema["additionalProperties"] is False
    jsonschema.validate(spec.example, tool.inputSchema)
    if "model" in tool.inputSchema["properties"]:  # the allow-list, as an enum: no paths
        assert sorted(tool.inputSchema["properties"]["model"]["anyOf"][0]["enum"]) == sorted(BUNDLED_MODELS)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**spec.example, "model": "/etc/passwd"}, tool.inputSchema)
    assert tool.outputSchema == output_schema(spec) and tool.outputSchema["type"] == "object"
    assert {"model", "summary", "findings"} <= set(tool.outputSchema["properties"])


# --- calling every tool ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TOOLS))
def test_every_tool_returns_structured_content(transcript, name) -> None:
    spec = TOOLS[name]
    result = transcript.results[name]
    assert not result.isError, f"{result.content[0].text}\n--- server log ---\n{transcript.log[-3000:]}"
    report = spec.output_model.model_validate(result.structuredContent)  # the project's own model
    jsonschema.validate(result.structuredContent, output_schema(spec))
    summary, serialised = result.content
    assert summary.text.startswith(report.summary)
    assert json.loads(serialised.text) == result.structuredContent


# --- errors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("label", "expected"),
    [
        ("layer", "layer 99 out of range 0..29"),
        ("model", "model '/etc/passwd' is not allowed here; allowed: minilm-l6, smollm2-135m-instruct"),
        ("type", "head: Input should be a valid integer"),
        ("extra", "unknown argument 'path'"),
        ("empty", "text is empty"),
        ("unknown_tool", "unknown tool 'no_such_tool'; tools: describe_model, show_attention"),
    ],
)
def test_errors_are_tool_errors_naming_what_is_valid(transcript, label, expected) -> None:
    result = transcript.errors[label]
    assert result.isError and result.structuredContent is None
    assert expected in result.content[0].text


def test_server_log_is_clean(transcript) -> None:
    assert "Traceback" not in transcript.log
    assert "loaded smollm2-135m-instruct" in transcript.log  # once, at start-up


# --- prompts -----------------------------------------------------------------------------------------------
def test_prompts(transcript) -> None:
    names = [p.name for p in transcript.prompts]
    assert names == ["attention_explainer", *(f"explain_{t}" for t in TOPICS)]
    collapse = next(p for p in transcript.prompts if p.name == "explain_collapse")
    assert [a.name for a in collapse.arguments] == ["text"]
    text = transcript.prompt.messages[0].content.text
    assert '"""The cat sat on the mat."""' in text and "`diagnose_collapse`" in text


# --- langchain-mcp-adapters ----------------------------------------------------------------------------------
def test_adapters_load_every_tool(transcript) -> None:
    assert transcript.agent["tool_names"] == list(TOOLS)


def test_agent_over_mcp_reads_structured_content(transcript) -> None:
    message = transcript.agent["correct_message"]
    assert message.status == "success"
    report = SHOW.output_model.model_validate(message.artifact["structured_content"])
    assert text_of(message).startswith(report.summary)
    final = transcript.agent["correct"]["messages"][-1]
    assert isinstance(final, AIMessage) and final.content == f"Layer 3: mean entropy {report.mean_entropy} nats."


def test_agent_over_mcp_corrects_itself(transcript) -> None:
    first, second = all_tool_messages(transcript.agent["corrected"]["messages"])
    assert first.status == "error" and "out of range 0..29" in text_of(first)
    assert second.status == "success" and second.artifact["structured_content"]["layer"] == 29
    assert transcript.agent["corrected"]["messages"][-1].content == "Layer 29 done."


# --- the command line and the HTTP transport ----------------------------------------------------------------
def test_mcp_command_defaults() -> None:
    args = build_parser().parse_args(["mcp"])
    assert (args.transport, args.host, args.model) == ("stdio", "127.0.0.1", "smollm2-135m-instruct")
    args = build_parser().parse_args(["--artifacts", "a", "mcp", "--allow-model", "x", "--allow-model", "y"])
    assert args.artifacts == "a" and args.allow_model == ["x", "y"]
    assert build_parser().parse_args(["mcp", "--artifacts", "b"]).artifacts == "b"


def test_mcp_server_limits_have_defaults_and_are_checked(capsys) -> None:
    from agent_tools.cli import main

    args = build_parser().parse_args(["mcp"])
    assert (args.call_timeout, args.max_sessions, args.session_idle) == (120.0, 64, 600.0)  # on for servers
    args = build_parser().parse_args(["mcp", "--call-timeout", "0", "--max-sessions", "3", "--session-idle", "5"])
    assert (args.call_timeout, args.max_sessions, args.session_idle) == (0.0, 3, 5.0)  # 0: no time limit
    for bad, message in (
        (["--call-timeout", "-1"], "--call-timeout must be a number of seconds >= 0"),
        (["--call-timeout", "nan"], "--call-timeout must be a number of seconds >= 0"),
        (["--max-sessions", "0"], "--max-sessions must be at least 1"),
        (["--session-idle", "0"], "--session-idle must be a positive number of seconds"),
    ):
        assert main(["mcp", *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and message in err[-1] and "Traceback" not in "\n".join(err)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_on_loopback(tmp_path) -> None:
    import httpx
    from mcp.client.streamable_http import streamablehttp_client

    port = _free_port()
    command = server_command(
        "--transport", "streamable-http", "--port", str(port), "--no-preload", "--tools", "describe_model",
        artifacts=tmp_path,
    )  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(command, env=ENV, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None, (tmp_path / "server.log").read_text()
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.3)
        # DNS-rebinding protection: a foreign Host header is refused
        foreign = httpx.post(url, headers={"Host": "evil.example", "Content-Type": "application/json"}, json={})
        assert foreign.status_code == 421

        async def session() -> tuple[list[str], types.CallToolResult]:
            async with streamablehttp_client(url) as (read, write, _), ClientSession(read, write) as client:
                await client.initialize()
                names = [t.name for t in (await client.list_tools()).tools]
                return names, await client.call_tool("describe_model", {"model": "minilm-l6"})

        names, result = anyio.run(session)
        assert names == ["describe_model"]
        assert not result.isError and result.structuredContent["num_layers"] == 6
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
