"""attention-explainer command line: readable tables for people, JSON for scripts.

    attention-explainer describe [--model M]
    attention-explainer show TEXT --layer L --head H [--model M] [--png FILE]
    attention-explainer call TOOL --json ARGS        (any tool; ARGS is JSON, @file.json or - for stdin)
    attention-explainer call TOOL --help             (the tool's arguments: type, default, range; its example)
    attention-explainer tools                        (list the tools and their input schemas)
    attention-explainer analyze [TEXT] [--out DIR]   (the full explanation: terminal, JSON, PNG, HTML)
    attention-explainer mcp [--transport T]          (serve every tool to an MCP client)

One module per subcommand, each with ``register(subparsers)`` (its parser, ``set_defaults(func=run)``) and
``run(args, inspector) -> exit code``. Modules import only the standard library, ``settings`` and ``errors`` at
load time; torch and transformers load inside ``run``, so ``--help`` and usage errors answer in a tenth of a
second.

Exit codes: 0 success, 2 a clear one-line error about the input, 1 a bug (with a traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from agent_tools.cli import analyze, call, corpus, describe, mcp, show, tools
from agent_tools.cli.placement_options import add_placement_options
from agent_tools.cli.session_args import session_from_args
from agent_tools.errors import AttentionToolError

# torch and transformers load only when a command runs: --help and usage errors stay fast
__all__ = ["build_parser", "main", "session_from_args"]

SUBCOMMANDS = (describe, show, call, tools, analyze, corpus, mcp)  # the order ``--help`` lists them in


def build_parser() -> argparse.ArgumentParser:
    """The global options (artifact folder, token limit, memory budget, placement) and every subcommand's parser."""
    parser = argparse.ArgumentParser(prog="attention-explainer", description="Look inside a transformer's attention.")
    parser.add_argument("--artifacts", default=None, help="folder for PNG/HTML artifacts the tools write")
    parser.add_argument("--token-limit", type=int, default=None, help="refuse texts longer than this many tokens")
    parser.add_argument(
        "--memory-budget",
        type=int,
        default=None,
        metavar="MIB",
        help="refuse calls estimated to hold more than this many MiB of attention maps on one device (default: 2048)",
    )
    parser.add_argument(
        "--allow-data",
        action="append",
        default=[],
        metavar="PATH",
        help="a data file or corpus run folder the corpus_summary tool may read; repeatable (default: none)",
    )
    add_placement_options(parser)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: parse, build the session, run the subcommand; an input error is one line, exit 2."""
    from agent_tools.runtime import tune_allocator

    tune_allocator()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        early = getattr(args, "early", None)  # a subcommand's answers before the session (and torch) exist
        if early is not None and (code := early(args)) is not None:
            return int(code)
        inspector = session_from_args(args)
        return int(args.func(args, inspector) or 0)
    except AttentionToolError as exc:
        return _one_line_error(exc.message)
    except OSError as exc:  # the machine's answer (read-only folder, full disk, missing path): not a bug
        from agent_tools.files import os_error_message

        return _one_line_error(os_error_message(exc))
    except RecursionError:  # input nested deeper than Python's parsers go (JSON 10,000 levels deep)
        return _one_line_error("the input is nested too deeply to read; flatten it (at most a few hundred levels)")
    except KeyboardInterrupt:  # Ctrl-C: no traceback, the shell's code for an interrupted command
        print("interrupted", file=sys.stderr)
        return 130


def _one_line_error(message: str) -> int:
    """Print ``error: MESSAGE`` as one line on stderr; exit code 2 (the input or the machine, not a bug)."""
    print("error: " + " ".join(message.splitlines()), file=sys.stderr)
    return 2
