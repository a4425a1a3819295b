"""``attention-explainer tools``: the declared tools with their descriptions, or their input JSON schemas."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent_tools.inspector import Inspector


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("tools", help="list the tools")
    p.add_argument("--json-schemas", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, inspector: Inspector) -> int:
    from agent_tools.tools import TOOLS

    if args.json_schemas:
        print(json.dumps({n: s.input_model.model_json_schema() for n, s in TOOLS.items()}, indent=2))
        return 0
    for name, spec in TOOLS.items():
        print(f"{name}: {spec.description}")
    return 0
