"""``attention-explainer tools``: the declared tools with their descriptions, or their input JSON schemas."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent_tools.inspector import Inspector

SCHEMA_FORMS = ("pydantic", "mcp", "openai-strict", "gemini")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("tools", help="list the tools")
    p.add_argument("--json-schemas", action="store_true", help="print every tool's input schema as JSON")
    p.add_argument(
        "--flavour",
        choices=SCHEMA_FORMS,
        default="pydantic",
        help="with --json-schemas: pydantic's own schema, or the $ref-free form for MCP, OpenAI strict function "
        "calling or Gemini function declarations",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace, inspector: Inspector) -> int:
    from agent_tools.surfaces.portable import portable_schema
    from agent_tools.tools import TOOLS

    if args.json_schemas:
        schemas = {
            name: spec.input_model.model_json_schema()
            if args.flavour == "pydantic"
            else portable_schema(spec.input_model, args.flavour)
            for name, spec in TOOLS.items()
        }
        print(json.dumps(schemas, indent=2, ensure_ascii=False))
        return 0
    for name, spec in TOOLS.items():
        print(f"{name}: {spec.description}")
    return 0
