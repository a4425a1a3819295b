"""The operator's placement flags (``--dtype``, ``--device``, ``--device-map``, ``--max-memory``,
``--offload-folder``, ``--quantization``), shared by the global options and ``mcp``.

Standard library only (``placement`` imports torch lazily), so ``--help`` stays fast. Values are checked by
:func:`agent_tools.placement.make_placement` when the session is built: a bad one is a one-line error, exit 2.
"""

from __future__ import annotations

import argparse
from typing import Any

from agent_tools.placement import DEVICE_FORMS, DEVICE_MAPS, DTYPES, MAX_MEMORY_FORM, QUANTIZATIONS


def add_placement_options(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """Add the placement flags; with ``suppress`` an absent flag leaves the global option's value in place."""
    default: Any = argparse.SUPPRESS if suppress else None
    group = parser.add_argument_group("model placement (the operator's choice; no tool argument changes it)")
    group.add_argument(
        "--dtype",
        choices=DTYPES,
        default=argparse.SUPPRESS if suppress else "auto",
        help="weights' precision; auto = the checkpoint's own dtype on an accelerator, float32 on a CPU",
    )
    group.add_argument(
        "--device",
        default=argparse.SUPPRESS if suppress else "auto",
        help=f"where the model runs: {DEVICE_FORMS}; auto = an accelerator when one exists",
    )
    group.add_argument(
        "--device-map",
        choices=DEVICE_MAPS,
        default=default,
        help="shard the model across GPUs, CPU and disk with accelerate (instead of --device)",
    )
    group.add_argument("--max-memory", default=default, metavar="SPEC", help=f"with --device-map: {MAX_MEMORY_FORM}")
    group.add_argument(
        "--offload-folder", default=default, metavar="DIR", help="with --device-map: where layers that fit nowhere go"
    )
    group.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=default,
        help="load linear layers in 8 or 4 bits with bitsandbytes (CUDA only; attention-explainer[quantized])",
    )


def placement_from_args(args: argparse.Namespace) -> Any:
    """The validated :class:`~agent_tools.placement.Placement` the flags describe."""
    from agent_tools.placement import make_placement

    return make_placement(
        dtype=getattr(args, "dtype", None) or "auto",
        device=getattr(args, "device", None) or "auto",
        device_map=getattr(args, "device_map", None),
        max_memory=getattr(args, "max_memory", None),
        offload_folder=getattr(args, "offload_folder", None),
        quantization=getattr(args, "quantization", None),
    )
