"""reconstruct_attention: one head's attention rebuilt step by step from the layer's input, ending at the model's map.

``models`` holds the arguments and report, ``plan`` the pass and the stage measures, ``narrative`` what each
stage adds, the findings and the summary. The pass and the parity check are shared with inspect_projections
(:mod:`agent_tools.consumers.head_inputs`, :mod:`agent_tools.head_inputs_pass`).
"""

from __future__ import annotations

from agent_tools.tools.reconstruct_attention.models import (
    DESCRIPTION,
    AttentionReconstruction,
    ReconstructAttentionInput,
)
from agent_tools.tools.reconstruct_attention.narrative import next_calls
from agent_tools.tools.reconstruct_attention.plan import Reconstruction, plan_reconstruct_attention, plan_reconstruction
from agent_tools.tools.registry import ToolSpec, Top

__all__ = [
    "SPEC",
    "AttentionReconstruction",
    "ReconstructAttentionInput",
    "Reconstruction",
    "plan_reconstruct_attention",
    "plan_reconstruction",
]

SPEC = ToolSpec(
    name="reconstruct_attention",
    description=DESCRIPTION,
    input_model=ReconstructAttentionInput,
    output_model=AttentionReconstruction,
    run=None,
    plan=plan_reconstruct_attention,
    example={"text": "The cat sat on the mat because it was tired.", "layer": 3, "head": 0},
    summary_lists=(
        Top("tokens", 32, order="first"),
        Top("stages[].top_keys", 16, by="position", label="query position (the last queries first)"),
    ),
    next_calls=next_calls,
    advanced=("mask_every_stage", "png"),
)
