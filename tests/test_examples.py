"""Every example runs: with a scripted model where an LLM would be needed, and a real MCP server process."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from scripted_chat import ScriptedChatModel, answer, ask, call, key_numbers, new_tool_messages

from agent_tools.cli import build_parser
from agent_tools.inspector import Inspector
from agent_tools.tools import TOOLS, get_tool

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SHOW = get_tool("show_attention")


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- examples/langchain_agent.py -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def langchain_agent() -> ModuleType:
    return load_example("langchain_agent")


def test_langchain_agent_says_what_is_needed_without_a_key(langchain_agent, monkeypatch, capsys) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert langchain_agent.main(["--llm", "openai:gpt-4.1-mini", "What does layer 3 head 0 read?"]) == 2
    err = capsys.readouterr().err
    assert "OPENAI_API_KEY" in err and "--llm provider:model" in err
    assert langchain_agent.main(["--llm", "gpt4"]) == 2
    assert "provider:model" in capsys.readouterr().err


def test_missing_requirements(langchain_agent, monkeypatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "x")
    needed = langchain_agent.missing_requirements("anthropic:claude")
    assert all("ANTHROPIC_API_KEY" not in n for n in needed)
    assert langchain_agent.missing_requirements("someprovider:model") == []


def show_then_answer(messages, bound):
    """A scripted LLM: calls show_attention once, then answers from the numbers it read."""
    received = new_tool_messages(messages)
    if not received:
        return ask(call("show_attention", **SHOW.example))
    numbers = key_numbers(received[0].content)
    return answer(f"Layer {numbers['layer']} head {numbers['head']} has mean entropy {numbers['mean_entropy']} nats.")


@pytest.mark.real_model
def test_langchain_agent_with_a_scripted_model(langchain_agent, tmp_path) -> None:
    model = ScriptedChatModel(policy=show_then_answer)
    agent = langchain_agent.build_agent(model, artifact_dir=tmp_path)
    text = langchain_agent.ask(agent, "What does layer 3 head 0 read?")
    assert text.startswith("Layer 3 head 0 has mean entropy 0.")
    system = model.turns[0][0]
    assert isinstance(system, SystemMessage)
    assert all(f"`{name}`" in system.content for name in TOOLS)  # the generated tool list
    assert [t["function"]["name"] for t in model.bindings[-1]] == list(TOOLS)


@pytest.mark.real_model
def test_langchain_agent_main_with_a_topic_template(langchain_agent, monkeypatch, capsys) -> None:
    seen = []

    def policy(messages, bound):
        seen.append(messages[1])
        return show_then_answer(messages, bound)

    import langchain.chat_models

    monkeypatch.setattr(langchain_agent, "missing_requirements", lambda llm: [])
    monkeypatch.setattr(langchain.chat_models, "init_chat_model", lambda llm: ScriptedChatModel(policy=policy))
    assert langchain_agent.main(["--llm", "any:model", "--topic", "projections", "--text", "The dog barked."]) == 0
    assert capsys.readouterr().out.startswith("Layer 3 head 0 has mean entropy")
    human = seen[0]
    assert isinstance(human, HumanMessage)
    assert "layer 3, head 0" in human.content and '"""The dog barked."""' in human.content


# --- examples/function_calling.py ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def function_calling() -> ModuleType:
    return load_example("function_calling")


def test_function_calling_says_what_is_needed(function_calling, monkeypatch, capsys) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert function_calling.main([]) == 2
    assert "OPENAI_API_KEY" in capsys.readouterr().err


@pytest.mark.real_model
def test_function_calling_loop_with_a_scripted_model(function_calling) -> None:
    def complete(messages, tools):
        """A scripted provider: reads the tool results (an error object, or the concise text) and decides."""
        assert {t["function"]["name"] for t in tools} == set(TOOLS)
        results = [m["content"] for m in messages if m["role"] == "tool"]
        if not results:
            bad = json.dumps({**SHOW.example, "layer": 40})
            return {"role": "assistant", "tool_calls": [tool_call("c1", bad)]}
        last = results[-1]
        if last.startswith("{"):
            high = int(json.loads(last)["message"].split("out of range 0..")[1].split(".")[0])
            fixed = json.dumps({**SHOW.example, "layer": high})
            return {"role": "assistant", "tool_calls": [tool_call("c2", fixed)]}
        numbers = dict(re.findall(r"(\w+)=([\w.]+)", last.split("Key numbers: ")[1].splitlines()[0]))
        return {
            "role": "assistant",
            "content": f"Layer {numbers['layer']}: mean entropy {numbers['mean_entropy']} nats.",
        }

    def tool_call(call_id: str, arguments: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": "show_attention", "arguments": arguments}}

    final, messages = function_calling.run_conversation("What does layer 40 head 0 read?", complete)
    error, result = (m["content"] for m in messages if m["role"] == "tool")
    error = json.loads(error)
    assert error["error"] == "invalid_input" and "layer 40 out of range 0..29" in error["message"]
    assert len(result.encode()) <= 2048 and not result.startswith("{")  # the concise text, not the whole report
    report = SHOW(Inspector(), {**SHOW.example, "layer": 29})
    assert final == f"Layer 29: mean entropy {report.mean_entropy} nats."
    assert messages[0]["role"] == "system" and "`show_attention`" in messages[0]["content"]


# --- examples/mcp_client_config.json and examples/mcp_client.py ----------------------------------------------
def test_mcp_client_config_starts_this_server() -> None:
    config = json.loads((EXAMPLES / "mcp_client_config.json").read_text())
    entry = config["mcpServers"]["attention-explainer"]
    assert entry["command"] == "attention-explainer"  # the console script pyproject.toml installs
    args = build_parser().parse_args(entry["args"])
    assert args.command == "mcp" and args.transport == "stdio"
    assert all(isinstance(v, str) for v in entry["env"].values())


@pytest.mark.real_model
def test_mcp_client_script_drives_the_server() -> None:
    command = [sys.executable, str(EXAMPLES / "mcp_client.py"), "--model", "minilm-l6", "--layer", "5", "--head", "11"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("connected to attention-explainer")
    assert lines[1] == "tools: " + ", ".join(TOOLS)
    assert lines[2] == "describe_model: 6 layers x 12 heads, head_dim 32"
    assert lines[3].startswith("show_attention: Layer 5 head 11 on ")
    assert lines[4].startswith("  query 0 '[CLS]' reads ")
    assert lines[-1].startswith("error (isError=True): ") and "layer 999 out of range 0..5" in lines[-1]


def test_readme_shows_the_same_mcp_configuration() -> None:
    readme = (ROOT / "README.md").read_text()
    block = next(b for b in readme.split("```json\n")[1:] if '"mcpServers"' in b).split("```")[0]
    assert json.loads(block) == json.loads((EXAMPLES / "mcp_client_config.json").read_text())
