"""Write and read the tools' declarations as data (``agent_tools/tool_declarations.json``), and the input schema
a session's agent sees, built from them without importing a tool.

    python -m agent_tools.surfaces.declarations           # rewrite the file from the registry (after a tool edit)
    python -m agent_tools.surfaces.declarations --check   # exit 1 when the file differs from the registry

:func:`agent_schema` is the MCP ``inputSchema`` of a tool for a session's :class:`~agent_tools.policy.ModelPolicy`:
the declared schema with ``model`` narrowed to the allow-list and the unadvertised arguments left out — the
JSON form of :func:`agent_tools.surfaces.agent_input_model` (a test checks both agree for every tool).
"""

from __future__ import annotations

import argparse
import json
import sys
from copy import deepcopy
from pathlib import Path
from typing import Any

from agent_tools.policy import ModelPolicy
from agent_tools.surfaces import SINGLE_STACK, model_field_description
from agent_tools.tool_declarations import DECLARATIONS_FILE


def build_declarations() -> dict[str, Any]:
    """Every declared tool's data, from the live registry (imports the tools: torch, transformers)."""
    from agent_tools.surfaces.mcp_server import output_schema
    from agent_tools.surfaces.portable import portable_schema
    from agent_tools.tools import PREFERRED_ORDER, TOOLS

    tools = {
        name: {
            "description": spec.description,
            "arguments": [[field, info.is_required()] for field, info in spec.input_model.model_fields.items()],
            "advanced": list(spec.advanced),
            "input_schema": portable_schema(spec.input_model, "mcp"),
            "output_schema": output_schema(spec),
        }
        for name, spec in TOOLS.items()
    }
    return {"preferred_order": list(PREFERRED_ORDER), "tools": tools}


def declarations_text(data: dict[str, Any]) -> str:
    """The file's text: one tool a block, stable across runs (reviewable diffs)."""
    return json.dumps(data, ensure_ascii=False, indent=1) + "\n"


def hidden_arguments(entry: dict[str, Any], policy: ModelPolicy) -> list[str]:
    """The arguments a session accepts but leaves out of the schema: the advanced ones, and ``attention`` when
    every allowed model has one attention stack."""
    properties = entry["input_schema"].get("properties", {})
    hidden = [name for name in entry["advanced"] if name in properties]
    if "attention" in properties and policy.allowed is not None and policy.allowed <= SINGLE_STACK:
        hidden.append("attention")
    return hidden


def agent_schema(entry: dict[str, Any], policy: ModelPolicy) -> dict[str, Any]:
    """A tool's input schema as the session's agent sees it (see the module docstring); a new dict each call."""
    schema = deepcopy(entry["input_schema"])
    properties: dict[str, Any] = schema.get("properties", {})
    for name in hidden_arguments(entry, policy):
        del properties[name]
    if "model" in properties:
        if policy.allowed is None:
            properties["model"] = {"description": model_field_description(policy), "type": "string"}
        elif len(policy.allowed) == 1:  # as pydantic writes a one-value Literal
            properties["model"] = {"const": next(iter(policy.allowed)), "type": "string"}
        else:
            properties["model"] = {"enum": sorted(policy.allowed), "type": "string"}
    return schema


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from the registry")
    parser.add_argument("--out", type=Path, default=DECLARATIONS_FILE)
    args = parser.parse_args(argv)
    text = declarations_text(build_declarations())
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run python -m agent_tools.surfaces.declarations", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(text.encode()):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
