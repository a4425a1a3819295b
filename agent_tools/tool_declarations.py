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
from collections.abc import Collection, Iterable
from copy import deepcopy
from functools import cache
from pathlib import Path
from typing import Any

from agent_tools.errors import InvalidInputError
from agent_tools.policy import BUNDLED_MODELS, ModelPolicy

DECLARATIONS_FILE = Path(__file__).with_name("tool_declarations.json")
SINGLE_STACK = frozenset(BUNDLED_MODELS)  # a decoder and an encoder: 'attention' has one value there, "self"


@cache
def tool_declarations() -> dict[str, dict[str, Any]]:
    """name -> declaration (``description``, ``example``, ``input_schema``, ``advanced``, ``arguments``,
    ``output_schema``)."""
    tools: dict[str, dict[str, Any]] = json.loads(DECLARATIONS_FILE.read_text(encoding="utf-8"))["tools"]
    return tools


def served_names(names: Any = None) -> list[str]:
    """The declared tools, or the named subset in declaration order; unknown, repeated or no names are refused."""
    declared = tuple(tool_declarations())
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


def model_choices(policy: ModelPolicy) -> str:
    """What ``model`` may name in this session, as the prompts' "Arguments" line says it (``{models}``): the
    allowed references, the default first, or any reference (the advertised schemas say only "a string")."""
    if policy.allowed is None:
        return model_field_description(policy)
    names = [f"`{policy.default}` (default)", *(f"`{name}`" for name in sorted(policy.allowed - {policy.default}))]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def hidden_arguments(advanced: Iterable[str], fields: Collection[str], policy: ModelPolicy) -> list[str]:
    """The arguments (of a tool's ``fields``) a session accepts but leaves out of the schema: the ``advanced`` ones,
    and ``attention`` when every allowed model has one attention stack."""
    hidden = [name for name in advanced if name in fields]
    if "attention" in fields and policy.allowed is not None and policy.allowed <= SINGLE_STACK:
        hidden.append("attention")
    return hidden


def agent_schema(entry: dict[str, Any], policy: ModelPolicy) -> dict[str, Any]:
    """A tool's input schema as the session's agent sees it: the declared schema without the unadvertised
    arguments, in :func:`shared_forms` (``model`` a string: its choices are the instructions' line) — the JSON form
    of :func:`agent_tools.surfaces.agent_input_schema` (a test checks both agree for every tool); a new dict each
    call. Standard library only: the MCP server's stdio front lists the tools with it before the SDK is imported."""
    schema = deepcopy(entry["input_schema"])
    properties: dict[str, Any] = schema.get("properties", {})
    for name in hidden_arguments(entry["advanced"], properties, policy):
        del properties[name]
    if "model" in properties:
        description = model_field_description(policy)
        properties["model"] = {"description": description, "type": "string"} if description else {"type": "string"}
    return shared_forms(schema)


# The arguments whose forms and meanings the prompts' "Arguments the tools share" block defines, once for every
# tool (``prompts/mcp_instructions.md``, the same lines in ``prompts/system.md``; tests/test_prompts.py holds each
# name to a line there): agents are shown each as its JSON type alone.
SHARED_ARGUMENTS = frozenset(
    {
        "detail", "model", "text", "layer", "head", "layers", "heads", "prompt", "prompt_a", "prompt_b", "segments",
        "answer", "wrong", "target_token", "resample_text", "target", "checks", "attention",
    }
)  # fmt: skip
# What a shared argument's advertised form keeps of its declared one besides the type: what the tool itself says
# of it (its own description and default, how many items or how large).
_OWN_KEYWORDS = ("description", "default", "minItems", "maxItems", "minimum", "maximum")
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}


def json_type(node: dict[str, Any], *, choices: bool = False) -> dict[str, Any]:
    """What kind of JSON value a (``$ref``-free) schema node takes, and nothing about its form: ``{"type": ...}``,
    or an ``anyOf`` of those for a union; choices (``enum``, ``const``) by the type of their values, or with
    ``choices`` as they are."""
    if "anyOf" in node:
        kinds: list[dict[str, Any]] = []
        for kind in (json_type(branch, choices=choices) for branch in node["anyOf"]):
            if kind not in kinds:
                kinds.append(kind)
        return {"anyOf": kinds} if len(kinds) > 1 else kinds[0]
    if choices and ("enum" in node or "const" in node):
        return {k: v for k, v in node.items() if k in ("type", "enum", "const")}
    if "type" in node:
        return {"type": node["type"]}
    values = node["enum"] if "enum" in node else [node["const"]] if "const" in node else []
    types = sorted({_JSON_TYPES[type(value)] for value in values})
    if not types:
        return {}
    return {"type": types[0]} if len(types) == 1 else {"anyOf": [{"type": kind} for kind in types]}


def shared_forms(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's input schema as agents are shown it (a new dict): each argument in :data:`SHARED_ARGUMENTS` as its
    JSON type with what the tool says of it, and the schema open (no ``additionalProperties``).

    The forms those arguments take — the chat messages, the head and segment forms, the stacks, the models a
    session allows — are written once in the instructions, not in every tool (issue 28: 10 KB for 18 tools'
    descriptions and schemas). A looser schema, never a wrong one: what it shows accepts every value the tool
    accepts, and the tool's own validation (the declared schema, also what ``call`` checks before a model loads)
    refuses the rest with a message naming the valid forms or names."""
    shown = {key: value for key, value in schema.items() if key != "additionalProperties"}
    if "properties" in schema:
        shown["properties"] = {
            name: {**json_type(node), **{k: node[k] for k in _OWN_KEYWORDS if k in node}}
            if name in SHARED_ARGUMENTS
            else node
            for name, node in schema["properties"].items()
        }
    return shown
