"""``attention-explainer mcp``: serve every tool to an MCP client (a desktop assistant, an IDE, an agent).

    attention-explainer mcp                                   # stdio; bundled models; default model preloaded
    attention-explainer mcp --model minilm-l6 --allow-model ./my-model --artifacts ~/attention-artifacts
    attention-explainer mcp --transport streamable-http --port 8765   # http://127.0.0.1:8765/mcp
    attention-explainer mcp --token-limit 2048 --memory-budget 512    # tokens per text, MiB of maps per call
    attention-explainer mcp --dtype bfloat16 --device cuda            # or --device-map auto --max-memory ...
    attention-explainer mcp --call-timeout 300                        # seconds per call (0: no limit)
    attention-explainer mcp --transport streamable-http --max-sessions 16 --session-idle 300
    attention-explainer mcp --text-content both                       # the report's JSON too, as text

Both MCP protocol eras are served: clients that open with ``initialize`` (2024-11-05 .. 2025-11-25) and
clients of the 2026-07-28 protocol (``server/discover``, a per-request envelope).

Which models the server may load, where it may write files, how long a text may be and how long a call may
run are fixed here, by the person who starts it; an agent's arguments cannot change them.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_tools.cli.placement_options import add_placement_options
from agent_tools.errors import InvalidInputError
from agent_tools.settings import ARTIFACTS_ENV, DEFAULT_MODEL, cache_dir, readable_size

# Defaults for a server (the library's own default is no limit): a call past 120 s holds the model from every
# other client (an 8,031-token diagnose_collapse ran 103 s); sessions as in mcp_server's DEFAULT_* constants,
# repeated here so that ``--help`` answers without importing the SDK.
DEFAULT_CALL_TIMEOUT = 120.0
DEFAULT_MAX_SESSIONS = 64
DEFAULT_SESSION_IDLE = 600.0
# A stdio server whose client closed stdin stops its calls at their next checkpoint, answers every request it read,
# and ends this long after the answers' grace (mcp_server.STOP_GRACE_SECONDS) even if a call has not reached one.
STDIN_CLOSED_EXIT_SECONDS = 1.5

if TYPE_CHECKING:
    from agent_tools.inspector import Inspector
    from agent_tools.policy import ModelPolicy


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "mcp",
        help="run an MCP server (stdio by default) exposing every tool",
        description="Run an MCP server exposing every attention-explainer tool, with input and output schemas.",
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="the default model, loaded at start-up (default: %(default)s)"
    )
    p.add_argument(
        "--allow-model",
        action="append",
        default=[],
        metavar="REF",
        help="also allow this model reference (a folder, .gguf file or hub id you trust); repeatable. "
        "Always allowed: the bundled models and --model",
    )
    p.add_argument("--tools", default=None, help="comma-separated tools to serve (default: all)")
    p.add_argument(
        "--artifacts",
        default=argparse.SUPPRESS,
        help="the only folder where tools may write PNG files (same as the global --artifacts; default: "
        "$ATTENTION_EXPLAINER_ARTIFACTS, else ~/.cache/attention-explainer/artifacts)",
    )
    p.add_argument("--no-artifacts", action="store_true", help="refuse every request to write a file")
    p.add_argument(
        "--token-limit",
        type=int,
        default=argparse.SUPPRESS,
        help="refuse texts longer than this many tokens (same as the global --token-limit; default: the model's)",
    )
    p.add_argument(
        "--memory-budget",
        type=int,
        default=argparse.SUPPRESS,
        metavar="MIB",
        help="refuse calls estimated to hold more than this many MiB of attention maps (same as the global "
        "option; default: 2048)",
    )
    p.add_argument(
        "--text-content",
        choices=("summary", "json", "both"),
        default="summary",
        help="text content beside the structured content: the concise text an LLM reads (default, about 2 KB "
        "at most), the report's JSON, or both (for clients that ignore structured content)",
    )
    p.add_argument("--transport", choices=("stdio", "streamable-http"), default="stdio")
    p.add_argument("--host", default="127.0.0.1", help="HTTP only; default 127.0.0.1 (this machine only)")
    p.add_argument("--port", type=int, default=8765, help="HTTP only (default: %(default)s)")
    p.add_argument("--no-preload", action="store_true", help="load the default model on first use, not at start-up")
    add_server_limits(p)
    add_placement_options(p, suppress=True)
    p.set_defaults(early=serve)  # every answer comes from serve: the session is built in the background


def add_server_limits(p: argparse.ArgumentParser) -> None:
    """The operator's limits on what one call and one client may hold: time per call, HTTP sessions."""
    p.add_argument(
        "--call-timeout",
        type=float,
        default=DEFAULT_CALL_TIMEOUT,
        metavar="SECONDS",
        help="stop a tool call that runs longer and answer it with a deadline_exceeded error, freeing the model "
        "for the next call (default: %(default)g; 0: no limit)",
    )
    p.add_argument(
        "--max-sessions",
        type=int,
        default=DEFAULT_MAX_SESSIONS,
        help="HTTP only: sessions open at once; a client opening one more gets 503 (default: %(default)s)",
    )
    p.add_argument(
        "--session-idle",
        type=float,
        default=DEFAULT_SESSION_IDLE,
        metavar="SECONDS",
        help="HTTP only: close a session with no request for this long (default: %(default)g)",
    )


def artifact_folder(args: argparse.Namespace) -> Path | None:
    """--artifacts (``~`` expanded), else $ATTENTION_EXPLAINER_ARTIFACTS, else the user cache folder.

    Not the working directory: a desktop client may start the server anywhere (even in ``/``).
    """
    if args.no_artifacts:
        return None
    chosen = getattr(args, "artifacts", None) or os.environ.get(ARTIFACTS_ENV)
    return Path(chosen).expanduser() if chosen else cache_dir() / "artifacts"


def session_inspector(args: argparse.Namespace) -> Inspector:
    """The server's inspector: an allow-list policy, the artifact folder (or none), the CLI's token limit,
    memory budget and placement (the placement flags after ``mcp`` override the global ones)."""
    from agent_tools.cli.session_args import session_from_args

    return session_from_args(args, policy=server_policy(args), artifact_dir=artifact_folder(args))


def _protocol_fd() -> int:
    """Keep fd 1 for the protocol only: anything else that prints (Python or native code) goes to stderr. Returns
    the protocol's own descriptor (a duplicate of the original fd 1)."""
    protocol_fd = os.dup(sys.stdout.fileno())
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    return protocol_fd


def _ended(code: int, why: str = "") -> None:
    """End a stdio server now: stop the calls in flight, flush, ``os._exit(code)``.

    Why not a return: the daemon thread reading stdin may be blocked inside ``sys.stdin.buffer.readline``, and an
    interpreter shutting down around it aborts on Ctrl-C ("Fatal Python error: _enter_buffered_busy", SIGABRT);
    and finalising a process that imported torch and transformers spent 4+ s collecting garbage after the client
    had closed stdin. Everything the server owes is written by then: its answers are flushed as they are sent.
    """
    server = sys.modules.get("agent_tools.surfaces.mcp_server")  # not imported when the stdio front answered all
    stop_running_calls = getattr(server, "stop_running_calls", None)
    if stop_running_calls is not None:
        stop_running_calls("the server was interrupted" if code else "the server ended")
    if why:
        print(f"attention-explainer MCP server: {why}", file=sys.stderr)
    from agent_tools.mcp_front import exit_flushed

    exit_flushed(code, (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__))


def server_policy(args: argparse.Namespace) -> ModelPolicy:
    """The allow-list: the bundled models, ``--model`` and every ``--allow-model``."""
    from agent_tools.policy import ModelPolicy

    return ModelPolicy.bundled_only(default=args.model, extra=tuple(args.allow_model))


def check_server_limits(args: argparse.Namespace) -> float | None:
    """Refuse limits that make no sense (one line, exit 2), and a device no machine has (one this machine lacks is
    found when the session is built: that needs torch); return the call timeout (None: no limit)."""
    if not 0 < args.port < 65536:
        raise InvalidInputError(f"--port {args.port} out of range 1..65535", field="port")
    if not args.call_timeout >= 0 or args.call_timeout == float("inf"):
        msg = f"--call-timeout must be a number of seconds >= 0 (0: no limit), got {args.call_timeout:g}"
        raise InvalidInputError(msg, field="call_timeout")
    if args.max_sessions < 1:
        raise InvalidInputError(f"--max-sessions must be at least 1, got {args.max_sessions}", field="max_sessions")
    if not 0 < args.session_idle < float("inf"):
        msg = f"--session-idle must be a positive number of seconds, got {args.session_idle:g}"
        raise InvalidInputError(msg, field="session_idle")
    if getattr(args, "device", None):
        from agent_tools.placement import check_device_form

        check_device_form(args.device)
    return args.call_timeout or None


def served_tools(args: argparse.Namespace) -> list[str]:
    """The tools ``--tools`` names (all declared tools without it); unknown or repeated names are refused."""
    from agent_tools.tool_declarations import served_names

    return served_names([t.strip() for t in args.tools.split(",") if t.strip()] if args.tools else None)


def serve(args: argparse.Namespace) -> int:
    """The ``mcp`` command, before any session exists: the server answers ``initialize`` and ``tools/list`` at
    once (over stdio before the MCP SDK is imported: :mod:`agent_tools.mcp_front`), while the inspector (torch,
    transformers, the tools) is built in the background from the global options, the policy and folder from
    ``mcp``'s own."""
    from agent_tools.cli.session_args import memory_budget_from_args

    memory_budget_from_args(args)  # a bad global option is refused here, at once (exit 2)
    make_session = partial(session_inspector, args)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.transport == "stdio":
        try:
            _serve_stdio(args, make_session)
        except KeyboardInterrupt:
            _ended(130, "interrupted")
        _ended(0)
    import anyio

    from agent_tools.surfaces.mcp_server import serve_http

    server = cli_server(args, make_session)
    limits = {"max_sessions": args.max_sessions, "session_idle": args.session_idle}
    anyio.run(partial(serve_http, server, host=args.host, port=args.port, **limits))
    return 0


def cli_server(args: argparse.Namespace, make_session: Callable[[], Inspector]) -> Any:
    """Import the SDK and build the server the ``mcp`` options describe (no torch yet: ``make_session`` runs in the
    background)."""
    call_timeout = check_server_limits(args)  # before the SDK loads: a bad option answers at once

    from agent_tools.cli.session_args import memory_budget_from_args
    from agent_tools.surfaces import heap
    from agent_tools.surfaces.mcp_server import build_server, quiet_sdk_loggers

    heap.bound_arenas()  # before the tools' worker threads start: they share a few malloc arenas (surfaces/heap.py)
    quiet_sdk_loggers()  # not one line per request or session; the SDK's warnings and errors still show
    policy = server_policy(args)
    server = build_server(
        make_inspector=make_session,
        policy=policy,
        tools=served_tools(args),
        text_content=args.text_content,
        preload=not args.no_preload,
        call_timeout=call_timeout,
    )
    allowed = ", ".join(sorted(policy.allowed or ()))
    artifacts = artifact_folder(args)
    limit = args.token_limit or "the model's own"
    print(
        f"attention-explainer MCP server ({args.transport}): default model {policy.default}; "
        f"allowed models: {allowed}; artifacts: {artifacts or 'disabled'}; "
        f"token limit: {limit}; memory budget: {readable_size(memory_budget_from_args(args))}; "
        f"call timeout: {f'{call_timeout:g} s' if call_timeout else 'none'}",
        file=sys.stderr,
        flush=True,
    )
    return server


def _serve_stdio(args: argparse.Namespace, make_session: Callable[[], Inspector]) -> None:
    """Serve stdio: the front (:mod:`agent_tools.mcp_front`) reads stdin at once and answers ``initialize`` and
    ``tools/list`` while the SDK is imported and the server built, then hands over. Options it can refuse without
    the SDK are refused first (exit 2)."""
    from agent_tools import __version__
    from agent_tools.mcp_front import REPLAYED_ID, StdioFront

    check_server_limits(args)
    names = served_tools(args)
    protocol_fd = _protocol_fd()
    front = StdioFront(
        names, server_policy(args), server_version=__version__, output=protocol_fd, on_done=partial(_ended, 0)
    )
    front.start(sys.stdin.buffer)
    server = cli_server(args, make_session)

    import anyio

    from agent_tools.surfaces.mcp_server import serve_stdio

    stdin = front.handoff()
    if stdin is None:  # the client closed stdin and the front answered everything it asked
        return
    stdout = anyio.wrap_file(io.TextIOWrapper(os.fdopen(protocol_fd, "wb"), encoding="utf-8"))
    serve = partial(
        serve_stdio,
        server,
        stdin=stdin,
        stdout=stdout,
        exit_after_close=STDIN_CLOSED_EXIT_SECONDS,
        drop_answer_to=REPLAYED_ID,
    )
    anyio.run(serve)
