"""``attention-explainer analyze``: the full explanation in the terminal, as JSON, PNG pictures and HTML."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_tools.errors import InvalidInputError
from agent_tools.report.long_context import LONG_CONTEXT_TOKENS

if TYPE_CHECKING:
    from agent_tools.inspector import Inspector
    from agent_tools.schemas import ChatMessage


def _read_messages(path: str) -> list[ChatMessage]:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidInputError(f"cannot read messages file {path}: {exc.strerror}", field="messages") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"messages file {path} is not valid JSON: {exc}", field="messages") from exc
    if isinstance(raw, dict) and "messages" in raw:
        raw = raw["messages"]
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        msg = f"messages file {path} must hold a JSON list of {{role, content}} objects"
        raise InvalidInputError(msg, field="messages")
    try:
        from agent_tools.schemas import ChatMessage

        return [ChatMessage.model_validate(m) for m in raw]
    except ValueError as exc:
        raise InvalidInputError(f"messages file {path}: each message needs role and content ({exc})") from exc


def check_out_folder(path: str) -> Path:
    """The ``--out`` folder, checked before the analysis (which takes seconds to minutes) rather than after it.

    It may exist (and must then be a writable folder) or be created — only it, inside an existing folder: a
    missing parent is more often a typo than a wish for a tree of new folders. Writability is tried with a
    temporary file, which also catches read-only file systems that permission bits do not show.
    """
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise InvalidInputError(
            f"--out {path} is a file, not a folder; give a folder for the report files", field="out"
        )
    folder = out if out.is_dir() else out.parent
    if not folder.is_dir():
        msg = f"--out {path}: the folder {folder} does not exist; create it first or give a folder inside one"
        raise InvalidInputError(msg, field="out")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        msg = f"--out {path}: cannot write in {folder} ({exc.strerror or type(exc).__name__}); give a writable folder"
        raise InvalidInputError(msg, field="out") from exc
    if not os.access(folder, os.W_OK):
        raise InvalidInputError(
            f"--out {path}: the folder {folder} is not writable; give a writable folder", field="out"
        )
    return out


def run(args: argparse.Namespace, inspector: Inspector) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from agent_tools.report.job import run_analysis
    from agent_tools.report.outputs import write_outputs
    from agent_tools.report.terminal import print_report

    if args.out:
        check_out_folder(args.out)
    text = args.text
    if args.messages and text is not None:
        raise InvalidInputError("give either TEXT or --messages, not both")
    try:
        layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    except ValueError as exc:
        msg = f"--layers {args.layers!r} is not a comma-separated list of layer numbers, e.g. 0,5,29"
        raise InvalidInputError(msg, field="layers") from exc
    loaded = inspector.model(args.model)  # before the progress display: a first-time conversion shows its own
    if args.messages:
        text = inspector.render_messages(loaded, _read_messages(args.messages))
    console = Console(stderr=args.as_json)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not sys.stderr.isatty(),
    ) as progress:
        task = progress.add_task("starting", total=None)
        result = run_analysis(
            inspector,
            text,
            model=args.model,
            layers=layers,
            experiment=not args.no_experiment,
            long_context=False if args.no_long_context else None,
            progress=lambda message: progress.update(task, description=message),
        )
        paths: dict[str, Any] = {}
        if args.out:
            progress.update(task, description="writing report files")
            paths = write_outputs(result, args.out)
    if args.as_json:
        print(result.to_report().model_dump_json(indent=2))
        return 0
    print_report(result, console)
    if paths:
        console.print(f"wrote {paths['html']}, {paths['json']} and {len(paths) - 2} PNG files to {args.out}")
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("analyze", help="the full explanation of a text: terminal, JSON, PNG and HTML")
    p.add_argument("text", nargs="?", default=None, help="text to analyse (a built-in text when omitted)")
    p.add_argument("--messages", default=None, help="JSON file of chat messages, rendered with the chat template")
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=None, help="folder for report.json, PNG pictures and report.html")
    p.add_argument("--layers", default=None, help="comma-separated layers for the per-head analyses (default all)")
    p.add_argument("--json", dest="as_json", action="store_true", help="print all reports as one JSON document")
    p.add_argument(
        "--no-experiment",
        action="store_true",
        help="skip the training experiment (a tiny model trained with and without 1/sqrt(d_k), ~1.5 s)",
    )
    p.add_argument(
        "--no-long-context",
        action="store_true",
        help=f"skip retrieval heads and the short-KV-cache plan (run by default on texts of at least "
        f"{LONG_CONTEXT_TOKENS} tokens; many forwards)",
    )
    p.set_defaults(func=run)
