"""ablate_heads: does a head matter? The change in the model's output when the named heads are removed.

``models`` holds the arguments, the report and the "L.H" head grammar (:func:`parse_heads`), ``plan`` the
clean and ablated forwards (through :meth:`Inspector.ablate`) and the effect sizes, ``narrative`` the summary
and findings.
"""

from __future__ import annotations

from agent_tools.tools.ablate_heads.models import (
    DESCRIPTION,
    AblateHeadsInput,
    AblationReport,
    parse_heads,
)
from agent_tools.tools.ablate_heads.plan import ablate_heads
from agent_tools.tools.registry import ToolSpec, Top

__all__ = [
    "SPEC",
    "AblateHeadsInput",
    "AblationReport",
    "ablate_heads",
    "parse_heads",
]

SPEC = ToolSpec(
    name="ablate_heads",
    description=DESCRIPTION,
    input_model=AblateHeadsInput,
    output_model=AblationReport,
    run=ablate_heads,
    example={"text": "The cat sat on the mat because it was tired.", "heads": ["3.0", "3.1"]},
    summary_lists=(
        Top("largest_effects", 10, by="value"),
        Top("direct_logit_attribution.top_heads", 10, by="logit", order="largest_abs"),
        Top("direct_logit_attribution.ablated", 10, by="logit", order="largest_abs"),
    ),
    advanced=("top_k", "baseline_draws", "seed"),
)
