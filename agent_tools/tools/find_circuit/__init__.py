"""find_circuit: which head reads which (Q-, K-, V-composition), the embeddings and the logits — EAP-IG edge
attribution between a clean and a corrupted prompt, pruned to a faithful circuit.

``models`` holds the arguments and report, ``plan`` the passes (:mod:`agent_tools.runner.edge_attribution`) and the
faithfulness curve, ``narrative`` a sentence per edge and the summary.
"""

from __future__ import annotations

from agent_tools.clean_corrupted import EXAMPLE
from agent_tools.tools.find_circuit.models import (
    DESCRIPTION,
    CircuitReport,
    FindCircuitInput,
)
from agent_tools.tools.find_circuit.plan import find_circuit
from agent_tools.tools.registry import ToolSpec, Top

__all__ = ["SPEC", "CircuitReport", "FindCircuitInput", "find_circuit"]

SPEC = ToolSpec(
    name="find_circuit",
    description=DESCRIPTION,
    input_model=FindCircuitInput,
    output_model=CircuitReport,
    run=find_circuit,
    example=EXAMPLE,
    summary_lists=(
        Top("edges", 12, by="score", order="largest_abs"),
        Top("nodes", 16, order="first"),
        Top("curve", 8, order="spaced"),
    ),
    advanced=("target", "steps", "max_edges"),
)
