"""Prompts for an attention-explainer agent: a system prompt and one explanation template per topic.

The texts live in the repository's top-level ``prompts/`` folder, which is installed as the package
``agent_tools.prompt_files`` (one copy; see ``setup.py``). Each file is Markdown with a small front matter
(``description: ...``) and is a LangChain f-string template. Two conventions keep them from going stale:

- ``{tool_catalogue}`` in the system prompt is filled from the tools' declarations at load time (name,
  description, arguments; :mod:`agent_tools.tool_declarations`, checked against :data:`agent_tools.tools.TOOLS`
  by a test), so the list always matches the declared tools, and reading it imports no tool (nor torch);
- ``[[tool_name]]`` marks a tool mention: it renders as `` `tool_name` `` when the tool is served, and the
  whole line is dropped when it is not (a toolkit serving a subset, or a tool not written yet).

    from agent_tools.prompts import explanation_template, system_prompt

    system_prompt()                                        # str, for create_agent(system_prompt=...)
    explanation_template("collapse").invoke({"text": "The cat sat on the mat."})
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from agent_tools.errors import InvalidInputError
from agent_tools.policy import ModelPolicy
from agent_tools.settings import DEFAULT_MODEL
from agent_tools.tool_declarations import model_choices, served_names, tool_declarations

if TYPE_CHECKING:  # LangChain loads when a template is built: the MCP server's first answers do without it
    from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate

Topic = Literal["collapse", "scaling", "head_roles", "projections", "prompt_debugging"]
TOPICS: tuple[Topic, ...] = get_args(Topic)

PROMPT_PACKAGE = "agent_tools.prompt_files"
SYSTEM_PROMPT_FILE = "system.md"
INSTRUCTIONS_FILE = "mcp_instructions.md"  # the MCP server's instructions
TOOL_MARKER = re.compile(r"\[\[([a-z][a-z0-9_]*)\]\]")


@dataclass(frozen=True)
class PromptFile:
    """One prompt file: its name, the description from its front matter, and the template text."""

    name: str
    description: str
    template: str


def prompt_folder() -> Traversable:
    """The installed prompt files; in a source checkout without a fresh install, the repository's ``prompts/``."""
    try:
        return resources.files(PROMPT_PACKAGE)
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "prompts"


def prompt_file_names() -> list[str]:
    return sorted(p.name for p in prompt_folder().iterdir() if p.name.endswith(".md"))


@cache
def read_prompt_file(name: str) -> PromptFile:
    """Parse ``name`` (e.g. ``system.md``): front matter ``key: value`` lines between ``---``, then the template."""
    if name not in prompt_file_names():
        raise InvalidInputError(f"no prompt file {name!r}; files: {', '.join(prompt_file_names())}", field="name")
    text = prompt_folder().joinpath(name).read_text(encoding="utf-8")
    meta: dict[str, str] = {}
    if text.startswith("---\n"):
        header, _, text = text[4:].partition("\n---\n")
        for line in header.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                meta[key.strip()] = value.strip()
    return PromptFile(name=name, description=meta.get("description", ""), template=text.strip() + "\n")


SHARED_ARGUMENTS_HEADING = "Arguments the tools share"


def shared_arguments(*, models: str | None = None) -> list[str]:
    """The "Arguments" block of the MCP instructions (the system prompt has the same lines; a test holds): the
    forms and meanings of the arguments the tools share, said once so that their schemas carry their JSON types
    alone (:func:`agent_tools.tool_declarations.shared_forms`). One line per bullet; ``call TOOL --help`` shows the
    lines naming the tool's arguments. ``models``: the ``model`` line's choices (default: the bundled models')."""
    text = read_prompt_file(INSTRUCTIONS_FILE).template
    block = text[text.index(SHARED_ARGUMENTS_HEADING) :].split("\n\n", 1)[0]
    choices = model_choices(ModelPolicy.bundled_only()) if models is None else models
    return [line.replace("{models}", choices) for line in block.splitlines()[1:]]


def render_tool_mentions(text: str, tools: Iterable[str] | None = None) -> str:
    """Replace ``[[tool]]`` with `` `tool` ``; drop each line that mentions a tool not served."""
    served = set(served_names(tools))
    kept = []
    for line in text.splitlines():
        mentioned = TOOL_MARKER.findall(line)
        if any(name not in served for name in mentioned):
            continue
        kept.append(TOOL_MARKER.sub(lambda m: f"`{m.group(1)}`", line))
    return "\n".join(kept) + ("\n" if text.endswith("\n") else "")


def tool_catalogue(tools: Iterable[str] | None = None) -> str:
    """One Markdown bullet per served tool: name, description, arguments (required ones marked)."""
    lines = []
    declared = tool_declarations()
    for name in served_names(tools):
        entry = declared[name]
        arguments = [f"{field}{' (required)' if required else ''}" for field, required in entry["arguments"]]
        lines.append(f"- `{name}`: {entry['description']} Arguments: {', '.join(arguments) or 'none'}.")
    return "\n".join(lines)


def system_prompt_template(*, tools: Iterable[str] | None = None) -> BasePromptTemplate:
    """The system prompt as a LangChain template with the tool list filled in; ``default_model`` and ``models``
    (the ``model`` argument's choices) stay variables, with the bundled models' values unless you pass others."""
    from langchain_core.prompts import PromptTemplate

    served = served_names(tools)
    text = render_tool_mentions(read_prompt_file(SYSTEM_PROMPT_FILE).template, served)
    return PromptTemplate.from_template(text).partial(
        tool_catalogue=tool_catalogue(served),
        default_model=DEFAULT_MODEL,
        models=model_choices(ModelPolicy.bundled_only()),
    )


def system_prompt(
    *, tools: Iterable[str] | None = None, default_model: str | None = None, policy: ModelPolicy | None = None
) -> str:
    """The system prompt for an attention-explainer agent, listing exactly the tools served; ``policy``: the
    models the session allows (default: the bundled ones, with ``default_model`` as the default)."""
    policy = policy or ModelPolicy.bundled_only(default_model or DEFAULT_MODEL)
    return system_prompt_template(tools=tools).format(default_model=policy.default, models=model_choices(policy))


def topic_file(topic: Topic) -> PromptFile:
    if topic not in TOPICS:
        raise InvalidInputError(f"unknown topic {topic!r}; topics: {', '.join(TOPICS)}", field="topic")
    return read_prompt_file(f"explain_{topic}.md")


def explanation_template(
    topic: Topic, *, tools: Iterable[str] | None = None, default_model: str | None = None
) -> ChatPromptTemplate:
    """A chat template for one topic: the system prompt, then the topic's request (variables such as ``text``)."""
    from langchain_core.messages import SystemMessage
    from langchain_core.prompts import ChatPromptTemplate

    served = served_names(tools)
    human = render_tool_mentions(topic_file(topic).template, served)
    system = SystemMessage(content=system_prompt(tools=served, default_model=default_model))
    return ChatPromptTemplate.from_messages([system, ("human", human)])
