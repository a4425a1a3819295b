"""patch_heads' arguments and report: activation patching between a clean and a corrupted prompt."""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent_tools.prompt_trace import NextCall
from agent_tools.schemas import ModelInput, Report
from agent_tools.stack_input import StackInput, StackReport

DESCRIPTION = (
    "Activation patching between a clean prompt and a corrupted one of the same token length: how much of the "
    "answer's logit difference each head and layer restores. Use to find the heads that carry an answer."
)
CLEAN_DESCRIPTION = "the prompt whose answer to explain, e.g. '… John gave a drink to'"
CORRUPTED_DESCRIPTION = "the same prompt, one fact changed, same token length, e.g. '… Mary gave a drink to'"
ANSWER_DESCRIPTION = "the clean answer, one token (mind a leading space); omitted = the top next token"
WRONG_DESCRIPTION = "the corrupted prompt's answer, one token; omitted = its top next token"


class PatchHeadsInput(ModelInput, StackInput):
    clean: str = Field(description=CLEAN_DESCRIPTION)
    corrupted: str = Field(description=CORRUPTED_DESCRIPTION)
    answer: str | None = Field(default=None, min_length=1, description=ANSWER_DESCRIPTION)
    wrong: str | None = Field(default=None, min_length=1, description=WRONG_DESCRIPTION)
    layers: list[int] | None = Field(default=None, description="omitted = all")
    top_k: int = Field(default=3, ge=1, le=20, description="heads listed first, and patched position by position")
    per_position: bool = Field(default=True, description="patch the top_k heads one position at a time as well")


class HeadPatchResult(BaseModel):
    layer: int
    head: int
    restored: float = Field(
        description="(LD_patched − LD_corrupted) / (LD_clean − LD_corrupted): the fraction of the logit difference "
        "this head's clean output restores in the corrupted run (1 all, 0 none, < 0 pushes the other way)"
    )
    logit_difference: float = Field(description="LD with the head patched: logit(answer) − logit(wrong), last position")


class LayerPatchResult(BaseModel):
    layer: int
    restored: float = Field(description="the fraction restored by patching every head of the layer at once")


class PositionPatch(BaseModel):
    position: int
    token: str = Field(description="the corrupted prompt's token there")
    restored: float


class HeadPositions(BaseModel):
    layer: int
    head: int
    positions: list[PositionPatch] = Field(
        description="the head patched at one position at a time; positions before the first difference between the "
        "prompts restore exactly 0 (the head's output there is the same in both runs) and are listed without a run"
    )


class PatchReport(Report, StackReport):
    tokens: int = Field(description="tokens in each prompt")
    first_difference: int = Field(description="first position where the prompts' tokens differ")
    differing_positions: list[int]
    answer: str
    answer_id: int
    wrong: str
    wrong_id: int
    logit_difference_clean: float = Field(
        description="logit(answer) − logit(wrong) at the clean prompt's last position"
    )
    logit_difference_corrupted: float
    direction: str = Field(description="what is copied where")
    layers: list[int]
    top_heads: list[HeadPatchResult] = Field(description="the top_k heads by |restored|, largest first")
    heads: list[HeadPatchResult] = Field(description="every patched head, in layer and head order")
    layer_results: list[LayerPatchResult]
    positions: list[HeadPositions] = Field(default_factory=list, description="per position, for the top heads")
    patched_runs: int = Field(description="patched variants run (rows of the batched forwards)")
    next_calls: list[NextCall] = Field(default_factory=list, description="calls that would confirm or refute the lead")
