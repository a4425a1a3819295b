"""Process-level tuning for the processes this package owns (CLI, MCP server, benchmarks) — never applied
just by importing the library.

Capture materialises one layer's attention at a time: tensors of H·q·T floats (150 MB at 2,048 tokens) that
are allocated and freed for every layer. glibc serves blocks that large with fresh ``mmap`` calls, so each one
is page-faulted in again: on this 2-core machine that made the softmax 4× slower than on reused memory
(92 ms vs 22 ms per layer at 2,048 tokens, benchmarks/bench_attention.py). Raising the mmap and trim
thresholds keeps freed blocks in the heap for the next layer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 30  # 1 GiB: larger than one layer's working set up to the budget's chunk size
_tuned = False


def tune_allocator() -> bool:
    """Keep large freed blocks for reuse (glibc only); returns whether the setting took effect."""
    global _tuned
    if _tuned:
        return True
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    _tuned = bool(mallopt(M_MMAP_THRESHOLD, _THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, _THRESHOLD))
    return _tuned
