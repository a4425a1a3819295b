"""patch_heads: which heads carry the answer? Activation patching between a clean and a corrupted prompt.

``models`` holds the arguments and report, ``plan`` the recorded and batched patched runs (through the inspector's
evidence methods, :mod:`agent_tools.runner.patching`), ``narrative`` the summary and findings.
"""

from __future__ import annotations

from agent_tools.clean_corrupted import EXAMPLE
from agent_tools.tools.patch_heads.models import (
    DESCRIPTION,
    PatchHeadsInput,
    PatchReport,
)
from agent_tools.tools.patch_heads.plan import patch_heads
from agent_tools.tools.registry import ToolSpec, Top

__all__ = [
    "SPEC",
    "PatchHeadsInput",
    "PatchReport",
    "patch_heads",
]

SPEC = ToolSpec(
    name="patch_heads",
    description=DESCRIPTION,
    input_model=PatchHeadsInput,
    output_model=PatchReport,
    run=patch_heads,
    example=EXAMPLE,
    summary_lists=(
        Top("heads", 20, by="restored", order="largest_abs"),
        Top("positions[].positions", 8, by="restored", order="largest_abs"),
        Top("layer_results", 10, by="restored", order="largest_abs"),
        Top("attribution.layers", 8, by="attention_exact", order="largest_abs"),
    ),
    advanced=("top_k", "per_position", "verify", "grad_drop", "saturation_fix"),
)
