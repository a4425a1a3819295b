"""attention-explainer command line: readable tables for people, JSON for scripts.

    attention-explainer describe [--model M]
    attention-explainer show TEXT --layer L --head H [--model M] [--png FILE]
    attention-explainer call TOOL --json ARGS        (any tool; ARGS is JSON, @file.json or - for stdin)
    attention-explainer tools                        (list the tools and their input schemas)

Exit codes: 0 success, 2 a clear one-line error about the input, 1 a bug (with a traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from agent_tools.errors import AttentionToolError, InvalidInputError
from agent_tools.settings import DEFAULT_MEMORY_BUDGET, default_artifact_dir

if TYPE_CHECKING:  # torch and transformers load only when a command runs: --help and usage errors stay fast
    from agent_tools.inspector import Inspector


def _console():
    from rich.console import Console

    return Console()


def _read_json_arg(raw: str) -> Any:
    if raw == "-":
        raw = sys.stdin.read()
    elif raw.startswith("@"):
        path = Path(raw[1:])
        try:
            raw = path.read_text()
        except OSError as exc:
            raise InvalidInputError(f"cannot read arguments file {path}: {exc.strerror}") from exc
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"--json is not valid JSON ({exc.msg} at character {exc.pos})") from exc


def cmd_call(args: argparse.Namespace, inspector: Inspector) -> int:
    from agent_tools.tools import get_tool

    spec = get_tool(args.tool)
    arguments = _read_json_arg(args.json) if args.json else {}
    if isinstance(arguments, dict) and args.model and "model" not in arguments:
        arguments["model"] = args.model
    report = spec(inspector, arguments)
    print(report.model_dump_json(indent=2))
    return 0


def cmd_tools(args: argparse.Namespace, inspector: Inspector) -> int:
    from agent_tools.tools import TOOLS

    if args.json_schemas:
        print(json.dumps({n: s.input_model.model_json_schema() for n, s in TOOLS.items()}, indent=2))
        return 0
    for name, spec in TOOLS.items():
        print(f"{name}: {spec.description}")
    return 0


def cmd_describe(args: argparse.Namespace, inspector: Inspector) -> int:
    from rich.table import Table

    from agent_tools.tools import get_tool

    report = get_tool("describe_model")(inspector, {"model": args.model})
    if args.as_json:
        print(report.model_dump_json(indent=2))
        return 0
    table = Table(title=f"Attention of {report.model}", show_header=False)
    for key in (
        "family",
        "architecture",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "hidden_size",
        "scaling",
        "inverse_sqrt_head_dim",
        "scaling_ratio",
        "positional",
        "mask",
        "max_positions",
        "sliding_window",
        "softcap",
        "num_parameters",
    ):
        table.add_row(key, str(getattr(report, key)))
    console = _console()
    console.print(table)
    console.print(report.summary)
    return 0


def cmd_show(args: argparse.Namespace, inspector: Inspector) -> int:
    from rich.table import Table

    from agent_tools.render import attention_heatmap
    from agent_tools.tools import get_tool

    arguments = {
        "model": args.model,
        "text": args.text,
        "layer": args.layer,
        "head": args.head,
        "top_k": args.top_k,
        "include_map": bool(args.png),
    }
    report = get_tool("show_attention")(inspector, arguments)
    if args.png:
        labels = [f"{t.position}:{t.text}" for t in report.tokens]
        path = attention_heatmap(
            report.weights or [], labels, labels, f"{report.model} — layer {report.layer}, head {report.head}", args.png
        )
        report.png_path = str(path)
    if args.as_json:
        print(report.model_dump_json(indent=2, exclude={"weights"}))
        return 0
    table = Table(title=f"{report.model}: layer {report.layer}, head {report.head} (KV head {report.kv_head})")
    table.add_column("pos", justify="right")
    table.add_column("query token")
    table.add_column("entropy", justify="right")
    table.add_column(f"top {args.top_k} keys (position:token weight)")
    for row in report.rows:
        keys = "  ".join(f"{k.position}:{k.token!r} {k.weight:.3f}" for k in row.top_keys)
        table.add_row(str(row.position), repr(row.token), f"{row.entropy:.3f}", keys)
    console = _console()
    console.print(table)
    console.print(report.summary)
    if report.png_path:
        console.print(f"heatmap written to {report.png_path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attention-explainer", description="Look inside a transformer's attention.")
    parser.add_argument("--artifacts", default=None, help="folder for PNG/HTML artifacts the tools write")
    parser.add_argument("--token-limit", type=int, default=None, help="refuse texts longer than this many tokens")
    parser.add_argument(
        "--memory-budget",
        type=int,
        default=None,
        metavar="MIB",
        help="refuse calls estimated to hold more than this many MiB of attention maps (default: 2048)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("describe", help="describe the model's attention")
    p.add_argument("--model", default=None)
    p.add_argument("--json", dest="as_json", action="store_true")
    p.set_defaults(func=cmd_describe)

    p = sub.add_parser("show", help="what one head attends to on a text")
    p.add_argument("text")
    p.add_argument("--layer", type=int, required=True)
    p.add_argument("--head", type=int, required=True)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--png", default=None, help="write the map as a PNG heatmap to this file")
    p.add_argument("--json", dest="as_json", action="store_true")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("call", help="run any tool by name with JSON arguments; prints the report as JSON")
    p.add_argument("tool")
    p.add_argument("--json", default=None, help="arguments: a JSON object, @file.json, or - for stdin")
    p.add_argument("--model", default=None)
    p.set_defaults(func=cmd_call)

    p = sub.add_parser("tools", help="list the tools")
    p.add_argument("--json-schemas", action="store_true")
    p.set_defaults(func=cmd_tools)

    from agent_tools.commands import register_all

    register_all(sub)
    return parser


def session_from_args(args: argparse.Namespace) -> Inspector:
    """The inspector the global options describe: artifact folder, token limit, memory budget."""
    if args.token_limit is not None and args.token_limit < 1:
        raise InvalidInputError(f"--token-limit must be at least 1, got {args.token_limit}", field="token_limit")
    budget = DEFAULT_MEMORY_BUDGET
    if args.memory_budget is not None:
        if args.memory_budget < 1:
            raise InvalidInputError(f"--memory-budget must be at least 1 MiB, got {args.memory_budget}")
        budget = args.memory_budget * 1024**2
    from agent_tools.inspector import Inspector

    return Inspector(
        artifact_dir=args.artifacts or default_artifact_dir(), token_limit=args.token_limit, memory_budget=budget
    )


def main(argv: Sequence[str] | None = None) -> int:
    from agent_tools.runtime import tune_allocator

    tune_allocator()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        inspector = session_from_args(args)
        return int(args.func(args, inspector) or 0)
    except AttentionToolError as exc:
        print("error: " + " ".join(exc.message.splitlines()), file=sys.stderr)  # one line, always
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
