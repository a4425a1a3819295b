"""compare_prompts: how attention over the prompt's parts shifts between two variants, and what the output does.

``models`` holds the arguments and report, ``plan`` the pass (both variants through the shared prompt trace,
:mod:`agent_tools.prompt_trace`, then their segments matched by name), ``narrative`` the summary and findings.
"""

from __future__ import annotations

from agent_tools.tools.compare_prompts.models import (
    DESCRIPTION,
    ComparePromptsInput,
    PromptComparison,
    SegmentComparison,
)
from agent_tools.tools.compare_prompts.plan import compare_prompts
from agent_tools.tools.registry import ToolSpec

__all__ = ["SPEC", "ComparePromptsInput", "PromptComparison", "SegmentComparison", "compare_prompts"]

SPEC = ToolSpec(
    name="compare_prompts",
    description=DESCRIPTION,
    input_model=ComparePromptsInput,
    output_model=PromptComparison,
    run=compare_prompts,
    example={
        "prompt_a": "The secret code is 4721. Question: what is the secret code? Answer:",
        "prompt_b": "Question: what is the secret code? The secret code is 4721. Answer:",
    },
)
