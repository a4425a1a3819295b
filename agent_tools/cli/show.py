"""``attention-explainer show TEXT --layer L --head H``: what one head attends to, as a table (and a PNG)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from agent_tools.errors import InvalidInputError

if TYPE_CHECKING:
    from agent_tools.inspector import Inspector
    from agent_tools.tools.show_attention import AttentionView


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("show", help="what one head attends to on a text")
    p.add_argument("text")
    p.add_argument("--layer", type=int, required=True)
    p.add_argument("--head", type=int, required=True)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--png", default=None, help="write the map as a PNG heatmap to this file")
    p.add_argument("--json", dest="as_json", action="store_true")
    p.set_defaults(func=run)


def check_png_path(path: str) -> Path:
    """The ``--png`` file, refused before the run unless its folder exists and can be written.

    Only what the option names is created: the file. A missing folder is the user's typo as often as not
    (``/nonexistent/dir/x.png`` used to create ``/nonexistent/dir``), so it is refused, not made.
    """
    png = Path(path).expanduser()
    folder = png.parent
    if png.is_dir():
        raise InvalidInputError(f"--png {path} is a folder; give a file name such as {png / 'map.png'}", field="png")
    if not folder.is_dir():
        msg = f"--png {path}: the folder {folder} does not exist; create it first or give a path in an existing folder"
        raise InvalidInputError(msg, field="png")
    if not os.access(folder, os.W_OK):
        raise InvalidInputError(f"--png {path}: the folder {folder} is not writable", field="png")
    return png


def run(args: argparse.Namespace, inspector: Inspector) -> int:
    from agent_tools.tools import get_tool

    if args.png:
        check_png_path(args.png)
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
        report.png_path = str(write_png(report, args.png))
    if args.as_json:
        print(report.model_dump_json(indent=2, exclude={"weights"}))
        return 0
    print_table(report, top_k=args.top_k)
    return 0


def write_png(report: AttentionView, path: str) -> Path:
    """The head's map as a heatmap labelled ``position:token`` on both axes; returns the path written."""
    from agent_tools.render import attention_heatmap

    labels = [f"{t.position}:{t.text}" for t in report.tokens]
    title = f"{report.model} — layer {report.layer}, head {report.head}"
    return attention_heatmap(report.weights or [], labels, labels, title, path)


def print_table(report: AttentionView, *, top_k: int) -> None:
    """One row per query token: its entropy and the keys it reads most."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report.model}: layer {report.layer}, head {report.head} (KV head {report.kv_head})")
    table.add_column("pos", justify="right")
    table.add_column("query token")
    table.add_column("entropy", justify="right")
    table.add_column(f"top {top_k} keys (position:token weight)")
    for row in report.rows:
        keys = "  ".join(f"{k.position}:{k.token!r} {k.weight:.3f}" for k in row.top_keys)
        table.add_row(str(row.position), repr(row.token), f"{row.entropy:.3f}", keys)
    console = Console()
    console.print(table)
    console.print(report.summary)
    if report.png_path:
        console.print(f"heatmap written to {report.png_path}")
