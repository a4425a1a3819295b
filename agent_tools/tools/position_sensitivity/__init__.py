"""position_sensitivity: does the answer depend on where the evidence sits (Liu et al. 2023, lost in the middle)?

``models`` holds the arguments and report, ``plan`` one captured pass per position of the moved segment,
``narrative`` the curve's shape and the best and worst position.
"""

from __future__ import annotations

from agent_tools.tools.position_sensitivity.models import (
    DESCRIPTION,
    PositionSensitivityInput,
    PositionSensitivityReport,
)
from agent_tools.tools.position_sensitivity.plan import position_sensitivity
from agent_tools.tools.registry import ToolSpec, Top

__all__ = ["SPEC", "PositionSensitivityInput", "PositionSensitivityReport", "position_sensitivity"]

_DOCS = [
    "The bakery opens at seven and sells rye bread.",
    "The museum is closed on Mondays for cleaning.",
    "The access code of the archive is 4721.",
    "The ferry leaves the harbour every two hours.",
]

SPEC = ToolSpec(
    name="position_sensitivity",
    description=DESCRIPTION,
    input_model=PositionSensitivityInput,
    output_model=PositionSensitivityReport,
    run=position_sensitivity,
    example={
        "prompt": " ".join(_DOCS) + " Question: what is the access code of the archive? Answer: the code is",
        "segments": [{"name": f"doc{i + 1}", "text": d} for i, d in enumerate(_DOCS)],
        "move": "doc3",
        "answer": " 4721",
        "positions": 4,
    },
    summary_lists=(Top("findings", 6, order="first"),),
)
