"""Agent surfaces generated from the tool declarations in :data:`agent_tools.tools.TOOLS`.

- :mod:`agent_tools.surfaces.langchain`: ``AttentionToolkit`` (StructuredTools, ``content_and_artifact``)
- :mod:`agent_tools.surfaces.mcp_server`: an MCP server (input and output schemas, structured content)
- :mod:`agent_tools.surfaces.openai`: OpenAI-style ``tools`` schemas and a dispatcher

What every surface shares lives here: which tools a session serves, the input model an agent sees (the
``model`` argument narrowed to the session's allow-list), the concise text an LLM reads, the error text.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

from agent_tools.errors import AttentionToolError, InvalidInputError
from agent_tools.loading import ModelPolicy
from agent_tools.schemas import Report
from agent_tools.tools import TOOLS
from agent_tools.tools.registry import ToolSpec

KEY_NUMBERS_LIMIT = 500  # characters of "key numbers" appended to the summary


def select_tools(names: Iterable[str] | None = None) -> list[ToolSpec]:
    """The declared tools, or the named subset (in declaration order); unknown or repeated names are refused."""
    if names is None:
        return list(TOOLS.values())
    chosen = list(names)
    unknown = [n for n in chosen if n not in TOOLS]
    if unknown:
        msg = f"unknown tool(s) {', '.join(map(repr, unknown))}; tools: {', '.join(TOOLS)}"
        raise InvalidInputError(msg, field="tools")
    if not chosen:
        raise InvalidInputError(f"the tool selection is empty; choose from: {', '.join(TOOLS)}", field="tools")
    if len(set(chosen)) != len(chosen):
        duplicates = sorted({n for n in chosen if chosen.count(n) > 1})
        raise InvalidInputError(f"the tool selection lists {duplicates} twice", field="tools")
    return [spec for name, spec in TOOLS.items() if name in chosen]


def model_field_description(policy: ModelPolicy) -> str:
    if policy.allowed is None:
        return (
            f"model to inspect (a bundled alias, a local folder, a .gguf file or a hub id); omitted = {policy.default}"
        )
    return f"model to inspect, one of: {', '.join(sorted(policy.allowed))}; omitted = {policy.default}"


def agent_input_model(spec: ToolSpec, policy: ModelPolicy) -> type[BaseModel]:
    """The tool's input model as this session's agent sees it.

    When the policy is an allow-list, ``model`` becomes an enum of the allowed references (so a client shows
    the choices and the schema refuses paths); validation otherwise is the declared model's, unchanged.
    """
    declared: type[BaseModel] = spec.input_model
    if "model" not in declared.model_fields:
        return declared
    return _narrowed_input_model(declared, policy.allowed, policy.default)


@cache
def _narrowed_input_model(
    input_model: type[BaseModel], allowed: frozenset[str] | None, default: str
) -> type[BaseModel]:
    description = model_field_description(ModelPolicy(allowed, default))
    if allowed is None:
        annotation: Any = str | None
    else:
        # A Literal built at run time from the allow-list: pydantic reads it, mypy cannot check it.
        annotation = Literal[tuple(sorted(allowed))] | None
    return create_model(
        input_model.__name__,
        __base__=input_model,
        __doc__=input_model.__doc__,
        model=(annotation, Field(default=None, description=description)),
    )


def key_numbers(report: BaseModel, *, limit: int = KEY_NUMBERS_LIMIT) -> str:
    """The report's top-level scalars (and short scalar lists) as ``name=value`` pairs, for the LLM's text."""
    skip = {"model", "summary", "findings"}
    parts = []
    for name in type(report).model_fields:
        if name in skip:
            continue
        value = getattr(report, name)
        if value is None or isinstance(value, BaseModel | dict):
            continue
        if isinstance(value, list | tuple):
            if not value or len(value) > 12 or not all(isinstance(v, int | float | str | bool) for v in value):
                continue
            value = "[" + ", ".join(map(str, value)) + "]"
        elif isinstance(value, str) and len(value) > 80:
            continue
        parts.append(f"{name}={value}")
    text = ", ".join(parts)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def concise_text(report: Report) -> str:
    """What an LLM reads: the summary, the top findings and the key numbers (the full report is an artifact)."""
    numbers = key_numbers(report)
    text = report.short_text()
    return f"{text}\nKey numbers: {numbers}" if numbers else text


def error_text(tool: str, error: AttentionToolError) -> str:
    """The error message an agent reads: what went wrong, naming what is valid, and that it can retry."""
    where = f" (argument {error.field!r})" if error.field else ""
    return f"Error [{error.kind}]{where}: {error.message.rstrip('.')}. Fix the arguments and call {tool} again."
