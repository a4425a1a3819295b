"""find_retrieval_heads: which heads fetch information from far back, and does retrieval need them?

``models`` holds the arguments and report, ``plan`` the captured passes over needle-in-a-haystack prompts and the
ablation check, ``narrative`` the summary, verdict and findings.
"""

from __future__ import annotations

from agent_tools.tools.find_retrieval_heads.models import (
    DESCRIPTION,
    FindRetrievalHeadsInput,
    FindRetrievalHeadsReport,
)
from agent_tools.tools.find_retrieval_heads.plan import find_retrieval_heads
from agent_tools.tools.registry import ToolSpec, Top

__all__ = [
    "SPEC",
    "FindRetrievalHeadsInput",
    "FindRetrievalHeadsReport",
    "find_retrieval_heads",
]

SPEC = ToolSpec(
    name="find_retrieval_heads",
    description=DESCRIPTION,
    input_model=FindRetrievalHeadsInput,
    output_model=FindRetrievalHeadsReport,
    run=find_retrieval_heads,
    example={"depths": [0.5], "lengths": [128], "top_k": 5, "random_draws": 2},
    summary_lists=(Top("heads", 10, by="score"), Top("haystacks", 10, order="first")),
    advanced=("seed",),
)
