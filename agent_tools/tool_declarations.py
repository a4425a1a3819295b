"""Every tool's declaration as data, read without importing a tool (standard library only).

``tool_declarations.json`` beside this module holds, per tool in the registry's order: the description, the
example, the input schema (the ``mcp`` flavour of its input model: ``$ref``-free), the advanced arguments, the
argument names (required or not) and the output schema ``tools/list`` advertises. The tools themselves import
torch and transformers (seconds), so whatever must answer before them — the MCP server's ``initialize``,
``tools/list`` and prompts, the system prompt's tool catalogue, ``call``'s ``--help`` and checks before the model
loads (:mod:`agent_tools.cli.catalogue`) — reads this file instead. It is generated from the live registry
(``python -m agent_tools.surfaces.declarations``), and ``tests/test_mcp_startup.py`` checks it equals what the
registry declares, so it cannot drift.
"""

from __future__ import annotations

import json
from copy import deepcopy
from functools import cache
from pathlib import Path
from typing import Any

from agent_tools.errors import InvalidInputError
from agent_tools.policy import BUNDLED_MODELS, ModelPolicy

DECLARATIONS_FILE = Path(__file__).with_name("tool_declarations.json")
SINGLE_STACK = frozenset(BUNDLED_MODELS)  # a decoder and an encoder: 'attention' has one value there, "self"


@cache
def _data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DECLARATIONS_FILE.read_text(encoding="utf-8"))
    return data


def tool_declarations() -> dict[str, dict[str, Any]]:
    """name -> declaration (``description``, ``example``, ``input_schema``, ``advanced``, ``arguments``,
    ``output_schema``)."""
    tools: dict[str, dict[str, Any]] = _data()["tools"]
    return tools


def declared_names() -> tuple[str, ...]:
    return tuple(tool_declarations())


def preferred_order() -> tuple[str, ...]:
    """The registry's listing order, planned tools included (the prompts may mention those)."""
    return tuple(_data()["preferred_order"])


def served_names(names: Any = None) -> list[str]:
    """The declared tools, or the named subset in declaration order; unknown, repeated or no names are refused."""
    declared = declared_names()
    if names is None:
        return list(declared)
    chosen = list(names)
    unknown = [n for n in chosen if n not in declared]
    if unknown:
        msg = f"unknown tool(s) {', '.join(map(repr, unknown))}; tools: {', '.join(declared)}"
        raise InvalidInputError(msg, field="tools")
    if not chosen:
        raise InvalidInputError(f"the tool selection is empty; choose from: {', '.join(declared)}", field="tools")
    if len(set(chosen)) != len(chosen):
        duplicates = sorted({n for n in chosen if chosen.count(n) > 1})
        raise InvalidInputError(f"the tool selection lists {duplicates} twice", field="tools")
    return [name for name in declared if name in chosen]


def model_field_description(policy: ModelPolicy) -> str:
    if policy.allowed is None:
        return f"a bundled alias, local folder, .gguf file or hub id; omitted = {policy.default}"
    return ""  # the allowed models are the schema's enum; omitted = the session's default


def hidden_arguments(entry: dict[str, Any], policy: ModelPolicy) -> list[str]:
    """The arguments a session accepts but leaves out of the schema: the advanced ones, and ``attention`` when
    every allowed model has one attention stack."""
    properties = entry["input_schema"].get("properties", {})
    hidden = [name for name in entry["advanced"] if name in properties]
    if "attention" in properties and policy.allowed is not None and policy.allowed <= SINGLE_STACK:
        hidden.append("attention")
    return hidden


def agent_schema(entry: dict[str, Any], policy: ModelPolicy) -> dict[str, Any]:
    """A tool's input schema as the session's agent sees it: the declared schema with ``model`` narrowed to the
    allow-list and the unadvertised arguments left out — the JSON form of
    :func:`agent_tools.surfaces.agent_input_model` (a test checks both agree for every tool); a new dict each call.
    Standard library only: the MCP server's stdio front lists the tools with it before the SDK is imported."""
    schema = deepcopy(entry["input_schema"])
    properties: dict[str, Any] = schema.get("properties", {})
    hidden = hidden_arguments(entry, policy)
    for name in hidden:
        del properties[name]
    if hidden:  # open: the schema must not refuse the arguments it leaves out (ToolInput.model_json_schema)
        schema.pop("additionalProperties", None)
    if "model" in properties:  # the choices without "type" (portable.untyped_choices)
        if policy.allowed is None:
            properties["model"] = {"description": model_field_description(policy), "type": "string"}
        elif len(policy.allowed) == 1:  # as pydantic writes a one-value Literal
            properties["model"] = {"const": next(iter(policy.allowed))}
        else:
            properties["model"] = {"enum": sorted(policy.allowed)}
    return schema
