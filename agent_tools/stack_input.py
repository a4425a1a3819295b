"""The ``attention`` argument every per-layer tool takes: which attention stack of the model to look at.

Base layer (pydantic only). A decoder-only or encoder-only model has one stack, ``"self"``; an encoder–decoder
(BART, T5, Marian, ...) has three: ``"encoder"`` (encoder self-attention), ``"decoder"`` (decoder
self-attention) and ``"cross"`` (each decoder position reading the encoder's output). Which stacks a model has,
and how deep each is, is :class:`~agent_tools.families.ModelFacts`'s to say; the inspector checks the choice.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from agent_tools.schemas import ToolInput

AttentionStack = Literal["self", "encoder", "decoder", "cross"]

# What the stacks are is said once in the prompts (prompts/mcp_instructions.md "Arguments"); the schema (shown only
# for a model with more than one stack) names the default.
ATTENTION_DESCRIPTION = "omitted = self, or encoder for an encoder–decoder"
TRACE_ATTENTION_DESCRIPTION = "self, or cross for an encoder–decoder (what its output read); omitted = the one there is"


class StackInput(ToolInput):
    """Mixin of the per-layer tools' inputs: the ``attention`` argument (None = the model's default stack)."""

    attention: AttentionStack | None = Field(default=None, description=ATTENTION_DESCRIPTION)


class StackReport(BaseModel):
    """Mixin of the per-layer tools' reports: the stack the numbers come from."""

    attention: str = Field(default="self", description="the attention stack looked at: self, encoder, decoder or cross")


STACK_PHRASES = {
    "encoder": "encoder self-attention",
    "decoder": "decoder self-attention (over the model's greedy answer)",
    "cross": "cross-attention (the answer's tokens reading the input)",
}


def on_stack(stack: str, summary: str) -> str:
    """A summary prefixed with the stack it is about (unchanged for a single-stack model's 'self')."""
    phrase = STACK_PHRASES.get(stack)
    return summary if phrase is None else f"On the {phrase}: {summary}"
