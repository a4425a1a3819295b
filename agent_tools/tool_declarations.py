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
from functools import cache
from pathlib import Path
from typing import Any

from agent_tools.errors import InvalidInputError

DECLARATIONS_FILE = Path(__file__).with_name("tool_declarations.json")


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
