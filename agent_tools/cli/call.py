"""``attention-explainer call TOOL --json ARGS``: run any tool by name; prints its report as JSON.

``call TOOL --help`` prints the tool's arguments (type, default, valid range, description) and its example. The
arguments are checked before anything heavy happens: first against the cached catalogue (no torch: a typo, a
wrong type, a layer past the model's answer at once), then by the tool's own validation, always before the
model loads.

``--format text`` (or ``--text``) prints the concise text the MCP, LangChain and OpenAI-style surfaces send an
LLM (at most 2 KB) instead of the whole report: what an agent that drives the command line should read. Long
texts in its ``next:`` calls are text handles (``"@text:<digest>"``), kept in the cache folder, that later
``call`` s accept in place of the text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_tools.errors import InvalidInputError

if TYPE_CHECKING:
    from agent_tools.inspector import Inspector

FORMATS = ("json", "text")
TEXTS_FOLDER = "texts"  # where ``call`` keeps the texts its next calls name by handle (the cache folder)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "call", help="run any tool by name with JSON arguments; prints the report as JSON", add_help=False
    )
    p.add_argument("tool", nargs="?", default=None)
    p.add_argument("--json", default=None, help="arguments: a JSON object, @file.json, or - for stdin")
    p.add_argument("--model", default=None)
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="json",
        help="json: the whole report (default); text: the concise text an agent reads (as MCP and LangChain send it)",
    )
    p.add_argument("--text", dest="format", action="store_const", const="text", help="same as --format text")
    p.add_argument("-h", "--help", action="store_true", help="the tool's arguments and example (or every tool)")
    p.set_defaults(func=run, early=early)


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


def _arguments(args: argparse.Namespace) -> Any:
    """``--json`` read once (stdin cannot be read twice), with ``--model`` merged in."""
    if not hasattr(args, "arguments"):
        arguments = read_json_argument(args.json) if args.json else {}
        if isinstance(arguments, dict) and args.model and "model" not in arguments:
            arguments["model"] = args.model
        args.arguments = arguments
    return args.arguments


def early(args: argparse.Namespace) -> int | None:
    """Before the session exists (no torch yet): ``--help``, and the checks the catalogue allows.

    Returns an exit code when the command is answered here, None to go on to :func:`run`.
    """
    from agent_tools.cli import catalogue
    from agent_tools.tool_declarations import tool_declarations

    tools = tool_declarations()
    if args.tool is None:
        if not args.help:
            msg = f"call needs a tool name: attention-explainer call TOOL --json ARGS; tools: {', '.join(tools)}"
            raise InvalidInputError(msg, field="tool")
        print(catalogue.tools_help(tools))
        return 0
    if args.tool not in tools:
        raise catalogue.unknown_tool(args.tool, tools)
    if args.help:
        print(catalogue.tool_help(args.tool, tools[args.tool]))
        return 0
    limit = getattr(args, "token_limit", None)
    catalogue.check_arguments(args.tool, _arguments(args), tools[args.tool], token_limit=limit)
    return None


def run(args: argparse.Namespace, inspector: Inspector) -> int:
    from agent_tools.inspector import check_list_lengths
    from agent_tools.settings import cache_dir
    from agent_tools.surfaces import concise_text
    from agent_tools.tools import get_tool

    spec = get_tool(args.tool)  # a name the declarations do not hold was refused by early, with a suggestion
    arguments = _arguments(args)
    check_list_lengths(arguments)  # 100,000-item lists are refused at once, as on the MCP server
    inspector.texts.folder = cache_dir() / TEXTS_FOLDER  # handles outlive this process: the next call reads them
    spec.parse(inspector.texts.resolve(arguments))  # every argument validated before the model loads
    report = spec(inspector, arguments)
    _remember_facts(inspector, arguments)
    print(concise_text(report) if args.format == "text" else report.model_dump_json(indent=2))
    return 0


def _remember_facts(inspector: Inspector, arguments: Any) -> None:
    """The model's layers, heads and positions, for the next call's checks before any model loads."""
    from agent_tools.cli import catalogue

    reference = arguments.get("model") if isinstance(arguments, dict) else None
    reference = reference.strip() if isinstance(reference, str) and reference.strip() else inspector.policy.default
    loaded = inspector.served(reference)
    if loaded is None or loaded.facts.is_encoder_decoder:
        return
    facts = {"layers": loaded.facts.num_layers, "heads": loaded.facts.num_heads}
    if loaded.facts.max_positions:
        facts["positions"] = loaded.facts.max_positions
    catalogue.remember_facts(reference, facts)
