"""A long-running server's C heap: glibc's malloc arenas bounded, and freed pages handed back after each call.

Why: a tool call runs in one of anyio's worker threads, and glibc gives each thread that allocates its own malloc
arena (up to 8 per core). Each arena keeps the high-water mark of the calls that ran in it, and pages freed in the
middle of an arena stay resident until something asks for them back. Under 8 concurrent clients the server's RSS
therefore climbs with every new thread and every new peak, slowly, without levelling off (1.14 -> 1.96 GiB over
8 x 100 calls in issue 29). :func:`bound_arenas` caps the arenas at :data:`ARENAS` (threads share them) and
:func:`release` (``malloc_trim(0)``) returns the free pages after every call. Both are no-ops off glibc, and
:func:`bound_arenas` leaves an operator's own ``MALLOC_ARENA_MAX`` alone.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import cache
from typing import Any

ARENAS = 2  # malloc arenas the server's threads share (glibc's default: 8 per core)
M_ARENA_MAX = -8  # mallopt's parameter number, from glibc's malloc.h


@cache
def _glibc() -> Any | None:
    """glibc's handle, or None (another C library, another system: nothing to tune)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def bound_arenas(count: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``count`` for the threads started from now on; True when it was set."""
    libc = _glibc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ:  # the operator's choice, read by glibc at start
        return False
    return bool(libc.mallopt(M_ARENA_MAX, count))


def release() -> bool:
    """Hand the heap's free pages back to the system (``malloc_trim(0)``); True when some were."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
