"""``attention-explainer call TOOL --json ARGS``: run any tool by name; prints its report as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_tools.errors import InvalidInputError

if TYPE_CHECKING:
    from agent_tools.inspector import Inspector


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("call", help="run any tool by name with JSON arguments; prints the report as JSON")
    p.add_argument("tool")
    p.add_argument("--json", default=None, help="arguments: a JSON object, @file.json, or - for stdin")
    p.add_argument("--model", default=None)
    p.set_defaults(func=run)


def read_json_argument(raw: str) -> Any:
    """``--json``'s value: JSON text, ``@path`` to a file holding it, or ``-`` for standard input."""
    if raw == "-":
        raw = sys.stdin.read()
    elif raw.startswith("@"):
        path = Path(raw[1:])
        try:
            raw = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidInputError(f"cannot read arguments file {path}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise InvalidInputError(f"arguments file {path} is not UTF-8 text (byte {exc.start})") from exc
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"--json is not valid JSON ({exc.msg} at character {exc.pos})") from exc
    except RecursionError as exc:  # Python's parser stops near 1,000 levels; no tool argument nests past a few
        msg = "--json is nested too deeply to read; tool arguments nest a few levels at most"
        raise InvalidInputError(msg) from exc


def run(args: argparse.Namespace, inspector: Inspector) -> int:
    from agent_tools.inspector import check_list_lengths
    from agent_tools.tools import get_tool

    spec = get_tool(args.tool)
    arguments = read_json_argument(args.json) if args.json else {}
    check_list_lengths(arguments)  # 100,000-item lists are refused at once, as on the MCP server
    if isinstance(arguments, dict) and args.model and "model" not in arguments:
        arguments["model"] = args.model
    report = spec(inspector, arguments)
    print(report.model_dump_json(indent=2))
    return 0
