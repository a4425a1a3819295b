"""``attention-explainer describe``: the model's attention card (describe_model) as a table, or as JSON."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent_tools.inspector import Inspector

CARD_FIELDS = (
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
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("describe", help="describe the model's attention")
    p.add_argument("--model", default=None)
    p.add_argument("--json", dest="as_json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, inspector: Inspector) -> int:
    from rich.console import Console
    from rich.table import Table

    from agent_tools.tools import get_tool

    report = get_tool("describe_model")(inspector, {"model": args.model})
    if args.as_json:
        print(report.model_dump_json(indent=2))
        return 0
    table = Table(title=f"Attention of {report.model}", show_header=False)
    for key in CARD_FIELDS:
        table.add_row(key, str(getattr(report, key)))
    console = Console()
    console.print(table)
    console.print(report.summary)
    return 0
