"""The session the global options describe (artifact folder, token limit, memory budget, placement): one module
that the console script and the subcommands that build their own session (``mcp``) both import."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from agent_tools.cli.placement_options import placement_from_args
from agent_tools.errors import InvalidInputError
from agent_tools.settings import DEFAULT_MEMORY_BUDGET, default_artifact_dir

if TYPE_CHECKING:
    from agent_tools.inspector import Inspector


def memory_budget_from_args(args: argparse.Namespace) -> int:
    """The memory budget in bytes the global options give, after checking them (standard library only)."""
    if args.token_limit is not None and args.token_limit < 1:
        raise InvalidInputError(f"--token-limit must be at least 1, got {args.token_limit}", field="token_limit")
    budget = DEFAULT_MEMORY_BUDGET
    if args.memory_budget is not None:
        if args.memory_budget < 1:
            raise InvalidInputError(f"--memory-budget must be at least 1 MiB, got {args.memory_budget}")
        budget = args.memory_budget * 1024**2
    return budget


def session_from_args(args: argparse.Namespace, **overrides: Any) -> Inspector:
    """The inspector the global options describe: artifact folder, token limit, memory budget, placement;
    ``overrides`` are other :class:`~agent_tools.inspector.Inspector` arguments (``mcp``: its policy and folder)."""
    budget = memory_budget_from_args(args)
    from agent_tools.inspector import Inspector

    options = {
        "artifact_dir": args.artifacts or default_artifact_dir(),
        "token_limit": args.token_limit,
        "memory_budget": budget,
        "placement": placement_from_args(args),
        "allowed_data": args.allow_data,
    }
    return Inspector(**{**options, **overrides})
