"""Prompts: the system prompt and the topic templates, generated tool lists, and shipping inside the wheel."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate

from agent_tools.errors import InvalidInputError
from agent_tools.mcp_front import server_instructions
from agent_tools.policy import BUNDLED_MODELS, ModelPolicy
from agent_tools.prompts import (
    SYSTEM_PROMPT_FILE,
    TOOL_MARKER,
    TOPICS,
    explanation_template,
    prompt_file_names,
    prompt_folder,
    read_prompt_file,
    render_tool_mentions,
    shared_arguments,
    system_prompt,
    system_prompt_template,
    tool_catalogue,
)
from agent_tools.settings import DEFAULT_MODEL
from agent_tools.tool_declarations import (
    SHARED_ARGUMENTS,
    agent_schema,
    model_choices,
    tool_declarations,
)
from agent_tools.tools import PREFERRED_ORDER, TOOLS

ROOT = Path(__file__).resolve().parents[1]
TOPIC_VARIABLES = {
    "collapse": ["text"],
    "scaling": ["text"],
    "head_roles": ["text"],
    "projections": ["head", "layer", "text"],
    "prompt_debugging": ["prompt", "question"],
}


def test_files_are_the_system_prompt_and_one_template_per_topic() -> None:
    expected = [SYSTEM_PROMPT_FILE, "mcp_instructions.md", *(f"explain_{t}.md" for t in TOPICS)]
    assert prompt_file_names() == sorted(expected)  # mcp_instructions.md: the MCP server's short instructions
    assert set(TOPIC_VARIABLES) == set(TOPICS)
    for name in prompt_file_names():
        prompt = read_prompt_file(name)
        assert prompt.description and not prompt.template.startswith("---")


def test_one_copy_in_the_repository() -> None:
    assert Path(str(prompt_folder())).resolve() == ROOT / "prompts"  # the editable install maps it here
    assert not (ROOT / "agent_tools" / "prompt_files").exists()


def mentioned_tools(text: str) -> set[str]:
    """The tool names a prompt text marks with ``[[...]]``."""
    return set(TOOL_MARKER.findall(text))


def test_mentions_name_only_planned_tools() -> None:
    planned = {*PREFERRED_ORDER, *TOOLS}  # the declared tools and those not written yet
    for name in prompt_file_names():
        assert mentioned_tools(read_prompt_file(name).template) <= planned, name


def test_the_shared_arguments_are_said_once_for_every_surface() -> None:
    """Issue 28: what the arguments every tool repeats mean (forms, ranges, defaults) is said once, in the MCP
    instructions and in the same words in the system prompt the LangChain and OpenAI surfaces use, so their schemas
    carry the types alone. Every argument that two or more tools show without a description is explained there."""
    lines = shared_arguments(models="{models}")
    block = "\n".join(lines)
    assert block in read_prompt_file("mcp_instructions.md").template
    assert block in read_prompt_file(SYSTEM_PROMPT_FILE).template
    policy = ModelPolicy.bundled_only("minilm-l6", extra=("./mine",))
    rendered = "\n".join(shared_arguments(models=model_choices(policy)))
    assert rendered in system_prompt(policy=policy)
    assert "`model`: `minilm-l6` (default), `./mine` or `smollm2-135m-instruct`." in rendered
    assert "\n".join(shared_arguments()) in system_prompt(default_model=DEFAULT_MODEL)  # the bundled models
    assert '"layer": 18, "head": 6' in block and "0-based" in block and '"18.6"' in block and "[18]" in block
    undescribed: dict[str, int] = {}
    for entry in tool_declarations().values():
        for name, schema in agent_schema(entry, ModelPolicy.bundled_only()).get("properties", {}).items():
            if "description" not in schema:
                undescribed[name] = undescribed.get(name, 0) + 1
    shared = sorted(name for name, count in undescribed.items() if count > 1)
    assert {"detail", "model", "text", "layer", "head", "layers", "prompt"} <= set(shared)
    for name in [*shared, "heads", "segments", "answer", "attention", "prompt_a", "prompt_b"]:
        assert f"`{name}`" in block, name


def _choices_and_fields(node: dict[str, Any]) -> tuple[set[str], set[str]]:
    """Every string choice (``enum``/``const``) and every object field name anywhere in a schema node."""
    choices = {c for c in [*node.get("enum", ()), node.get("const")] if isinstance(c, str)}
    fields = set(node.get("properties", {}))
    items = [node["items"]] if isinstance(node.get("items"), dict) else []
    for child in [*node.get("properties", {}).values(), *node.get("anyOf", ()), *items]:
        more = _choices_and_fields(child)
        choices, fields = choices | more[0], fields | more[1]
    return choices, fields


def test_every_form_agents_are_not_shown_is_in_the_block() -> None:
    """Agents are shown each shared argument as its JSON type alone (``tool_declarations.shared_forms``): the block
    must say every form it takes, so that an agent reading ``tools/list`` and the instructions can write every
    valid call. Each choice of a shared argument (quoted), each field of its objects (chat messages, head objects,
    segments), each nested length limit and each allowed model is in the instructions' block."""
    block = "\n".join(shared_arguments())
    assert {f"`{name}`" for name in SHARED_ARGUMENTS} <= set(re.findall(r"`[a-z_]+`", block))
    checked = set()
    for entry in tool_declarations().values():
        shown = agent_schema(entry, ModelPolicy(None))["properties"]  # every argument some session shows
        for name in SHARED_ARGUMENTS & set(shown):
            declared = entry["input_schema"]["properties"][name]
            choices, fields = _choices_and_fields(declared)
            for choice in choices:
                assert f'"{choice}"' in block, (name, choice)
            for field in fields:
                assert re.search(rf"\b{field}\b", block), (name, field)
            for limit in re.findall(r'"maxLength": (\d+)', json.dumps(declared.get("items", {}))):
                assert f"≤ {limit} characters" in block, (name, limit)
            checked.add(name)
    assert {"prompt", "segments", "heads", "checks", "target", "detail", "attention"} <= checked
    instructions = server_instructions(list(tool_declarations()), ModelPolicy.bundled_only())
    assert all(f"`{model}`" in instructions for model in BUNDLED_MODELS)


def test_system_prompt_lists_every_declared_tool() -> None:
    text = system_prompt()
    for name, spec in TOOLS.items():
        assert f"- `{name}`: {spec.description}" in text
    assert "[[" not in text and "{" not in text
    assert "smollm2-135m-instruct" in text
    for rule in (
        "Never invent numbers",
        "no-op sink",
        "never call a head harmful from value norms alone",
        "variance is d_k",
        "layer, the head, the token",
    ):
        assert rule in text


def test_catalogue_marks_required_arguments() -> None:
    line = next(line for line in tool_catalogue().splitlines() if line.startswith("- `show_attention`"))
    assert "text (required), layer (required), head (required), top_k" in line


def test_lines_about_tools_not_served_are_dropped() -> None:
    text = system_prompt(tools=["describe_model"], default_model="minilm-l6")
    assert "`describe_model`" in text and "`show_attention`" not in text
    assert "by default `minilm-l6`" in text
    assert "Tell a no-op sink from a collapse that matters" in text  # reasoning rules stay
    with pytest.raises(InvalidInputError, match="unknown tool"):
        system_prompt(tools=["nope"])


def test_render_tool_mentions() -> None:
    text = "- use [[describe_model]] first\n- then [[no_such_tool]]\nplain line\n"
    assert render_tool_mentions(text, ["describe_model"]) == "- use `describe_model` first\nplain line\n"


def test_system_prompt_template_is_a_langchain_template() -> None:
    template = system_prompt_template(tools=["describe_model", "show_attention"])
    assert template.input_variables == []
    assert "by default `gpt2`" in template.format(default_model="gpt2")


@pytest.mark.parametrize("topic", TOPICS)
def test_topic_templates(topic) -> None:
    template = explanation_template(topic)
    assert isinstance(template, ChatPromptTemplate)
    assert sorted(template.input_variables) == TOPIC_VARIABLES[topic]
    values = {name: f"<{name}>" for name in template.input_variables}
    system, human = template.invoke(values).to_messages()
    assert isinstance(system, SystemMessage) and system.content == system_prompt()
    assert isinstance(human, HumanMessage)
    for value in values.values():
        assert value in human.content
    assert "[[" not in human.content
    for name in mentioned_tools(read_prompt_file(f"explain_{topic}.md").template):
        assert (f"`{name}`" in human.content) == (name in TOOLS)


def test_topic_template_for_a_subset_and_unknown_topic() -> None:
    template = explanation_template("collapse", tools=["describe_model", "show_attention"])
    human = template.invoke({"text": "x"}).to_messages()[1].content
    assert "`show_attention`" in human and "diagnose_collapse" not in human
    with pytest.raises(InvalidInputError, match="topics: collapse"):
        explanation_template("poetry")  # type: ignore[arg-type]


@pytest.mark.slow
def test_wheel_ships_the_prompt_files_and_loads_them(tmp_path) -> None:
    source = tmp_path / "src"  # a clean copy: no build/ or egg-info of the working tree leaks in
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("agent_tools", "prompts"):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*build, "-w", str(wheels)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("attention_explainer-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for name in prompt_file_names():
            assert archive.read(f"agent_tools/prompt_files/{name}") == (ROOT / "prompts" / name).read_bytes()
    target = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    probe = (
        "import agent_tools.prompts as p; from agent_tools.prompts import system_prompt; "
        "print(p.__file__); print(p.prompt_folder()); print(len(system_prompt()))"
    )
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    module_file, folder, length = result.stdout.split()
    assert module_file.startswith(str(target)) and folder == str(target / "agent_tools" / "prompt_files")
    assert int(length) > 1000
