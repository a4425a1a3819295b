"""The MCP server answers before torch (issue 28): ``tools/list`` and the prompts come from the tools' declaration
data, which must equal what the registry declares, and nothing imports torch before the first ``tools/call``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from mcp import types

from agent_tools.mcp_front import tool_listing
from agent_tools.policy import ModelPolicy
from agent_tools.prompts import system_prompt
from agent_tools.surfaces import agent_input_schema
from agent_tools.surfaces.declarations import build_declarations, declarations_text, output_schema
from agent_tools.tool_declarations import DECLARATIONS_FILE, agent_schema, tool_declarations
from agent_tools.tools import TOOLS

POLICIES = [
    ModelPolicy.bundled_only(),
    ModelPolicy.bundled_only(default="minilm-l6", extra=("./my-model", "org/other")),
    ModelPolicy(frozenset({"minilm-l6"}), "minilm-l6"),
    ModelPolicy(None),  # any model: a free-form string
]


def test_the_declarations_file_is_what_the_registry_declares() -> None:
    built = declarations_text(build_declarations())
    assert DECLARATIONS_FILE.read_text(encoding="utf-8") == built, (
        "agent_tools/tool_declarations.json is out of date: run python -m agent_tools.surfaces.declarations"
    )
    assert list(tool_declarations()) == list(TOOLS)


@pytest.mark.parametrize("policy", POLICIES, ids=["bundled", "extra", "one", "any"])
def test_agent_schemas_from_data_equal_the_live_input_models(policy: ModelPolicy) -> None:
    """The JSON narrowing (advanced and one-stack ``attention`` left out, the shared arguments in their compact
    forms) is the same schema the OpenAI surface builds from the pydantic models."""
    for name, spec in TOOLS.items():
        live = agent_input_schema(spec, policy)
        assert agent_schema(tool_declarations()[name], policy) == live, name
        assert list(agent_schema(tool_declarations()[name], policy)["properties"]) == list(live["properties"]), name
        listed = types.Tool.model_validate(tool_listing([name], policy)["tools"][0])  # what tools/list says
        assert (listed.description, listed.input_schema, listed.output_schema) == (
            spec.description,
            live,
            output_schema(spec),
        ), name


def test_the_system_prompt_lists_every_tool_with_its_arguments() -> None:
    text = system_prompt()
    for name, spec in TOOLS.items():
        arguments = ", ".join(
            f"{f}{' (required)' if i.is_required() else ''}" for f, i in spec.input_model.model_fields.items()
        )
        assert f"- `{name}`: {spec.description} Arguments: {arguments}." in text


# --- a server process: nothing imports torch before the first tools/call ----------------------------------------
SCRIPT = textwrap.dedent(
    """
    import json, sys, threading, anyio
    from mcp import Client
    from agent_tools.cli import build_parser
    from agent_tools.cli.mcp import cli_server
    from agent_tools.surfaces.mcp_server import build_server
    from agent_tools.policy import ModelPolicy

    HEAVY = ("torch", "transformers", "agent_tools.tools", "agent_tools.inspector")
    seen = {}

    def heavy():
        return sorted(m for m in HEAVY if m in sys.modules)

    def session():
        from agent_tools.inspector import Inspector
        return Inspector(policy=ModelPolicy.bundled_only(), artifact_dir=sys.argv[1])

    gate, entered = threading.Event(), threading.Event()

    def gated_session():  # the background build waits here (never released): torch stays out of this process
        entered.set()
        gate.wait()

    async def main():
        server = build_server(make_inspector=gated_session, policy=ModelPolicy.bundled_only())
        seen["preload built"] = heavy()
        async with Client(server) as client:
            seen["preload tools"] = len((await client.list_tools()).tools)
            await client.list_prompts()
            await client.get_prompt("attention_explainer")
            seen["preload listed"] = heavy()
            seen["preload started"] = entered.wait(60)  # the lifespan started the background build

        args = build_parser().parse_args(["--artifacts", sys.argv[1], "mcp", "--no-preload"])
        server = cli_server(args, session)
        seen["cli built"] = heavy()
        async with Client(server) as client:
            seen["cli tools"] = len((await client.list_tools()).tools)
            await client.list_prompts()
            await client.get_prompt("attention_explainer")
            seen["cli listed"] = heavy()
            result = await client.call_tool("corpus_summary", {})
            seen["cli called"] = heavy()
            seen["cli error"] = result.is_error

    anyio.run(main)
    print(json.dumps(seen))
    """
)


@pytest.mark.slow
def test_the_server_answers_before_importing_torch(tmp_path) -> None:
    """In a fresh process: building the server as the ``mcp`` command does, ``initialize``, ``tools/list`` and the
    prompts import neither torch nor a tool (so they answer in a second, not after the seconds torch takes); the
    first ``tools/call`` brings them in. With preloading, the lifespan starts the background build, held here at a
    gate so that the answers provably did not wait for it."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    for label in ("cli", "preload"):
        assert seen[f"{label} built"] == [] and seen[f"{label} listed"] == [], seen
        assert seen[f"{label} tools"] == len(TOOLS), seen
    assert seen["preload started"] is True and seen["cli error"] is False, seen
    assert {"torch", "agent_tools.tools", "agent_tools.inspector"} <= set(seen["cli called"]), seen
