"""Session defaults every layer shares — the default model, the cache and artifact folders, the memory budget.

Standard library only, so the command line can build its parser (``--help``, argument errors) without
importing torch or transformers (about 3 s on a 2-core machine).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
CACHE_ENV = "ATTENTION_EXPLAINER_CACHE"
ARTIFACTS_ENV = "ATTENTION_EXPLAINER_ARTIFACTS"
# "0": dtype auto on a CPU stays float32 even where the CPU has bfloat16 hardware (the same numbers on every
# machine; the test suite sets it, its 1e-5 parity checks are float32's)
CPU_BF16_ENV = "ATTENTION_EXPLAINER_CPU_BF16"
DEFAULT_MEMORY_BUDGET = 2 * 1024**3  # bytes a single call may hold in maps it keeps


def cache_dir() -> Path:
    """The user cache folder for converted weights (``$ATTENTION_EXPLAINER_CACHE`` overrides it)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "attention-explainer"


def default_artifact_dir() -> Path:
    """Where the command line writes artifacts unless told (``$ATTENTION_EXPLAINER_ARTIFACTS`` overrides it)."""
    return Path(os.environ.get(ARTIFACTS_ENV, "attention-explainer-artifacts"))


def readable_size(count: float) -> str:
    """Bytes as B, KiB, MiB or GiB with three significant figures."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if count >= scale:
            value = count / scale
            return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return f"{int(count)} B"


def cpu_bf16_switched_off() -> bool:
    """Whether the operator switched off bfloat16 for ``auto`` on the CPU (``$ATTENTION_EXPLAINER_CPU_BF16=0``)."""
    return os.environ.get(CPU_BF16_ENV, "").strip().lower() in {"0", "false", "no", "off"}
