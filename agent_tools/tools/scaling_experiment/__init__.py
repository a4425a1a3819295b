"""scaling_experiment: "my model refused to converge", reproduced on a tiny head with and without 1/sqrt(d_k).

``models`` holds the arguments and report, ``plan`` the four training runs (no pretrained model, so no shared
pass) and ``narrative`` the summary, findings and task text.
"""

from __future__ import annotations

from agent_tools.tools.registry import ToolSpec, Top
from agent_tools.tools.scaling_experiment.models import (
    CURVES,
    DESCRIPTION,
    ScalingExperimentInput,
    ScalingExperimentReport,
)
from agent_tools.tools.scaling_experiment.narrative import next_calls
from agent_tools.tools.scaling_experiment.plan import scaling_experiment

__all__ = [
    "SPEC",
    "ScalingExperimentInput",
    "ScalingExperimentReport",
    "scaling_experiment",
]

SPEC = ToolSpec(
    name="scaling_experiment",
    description=DESCRIPTION,
    input_model=ScalingExperimentInput,
    output_model=ScalingExperimentReport,
    run=scaling_experiment,
    example={"steps": 60},
    summary_lists=tuple(Top(f"runs[].{curve}", 16, order="spaced") for curve in CURVES),  # each curve thinned alike
    next_calls=next_calls,
    advanced=("learning_rate", "items", "batch", "log_every", "seed"),
)
