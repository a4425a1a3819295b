"""Extra CLI subcommands, one module each (e.g. ``analyze``, ``mcp``), discovered automatically.

A module here defines ``register(subparsers)`` that adds its parser with ``set_defaults(func=...)``; the
function receives ``(args, inspector)`` and returns an exit code.
"""

from __future__ import annotations

import pkgutil
from importlib import import_module
from typing import Any


def register_all(subparsers: Any) -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
