"""patch_heads' arguments and report: activation patching between a clean and a corrupted prompt."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, Field

from agent_tools.schemas import HeadRow, ModelInput, Report, Rounded
from agent_tools.stack_input import StackInput, StackReport

DESCRIPTION = (
    "Activation patching clean → corrupted (same token length): the share of the logit difference each head "
    "restores, vs random heads. Use to find heads carrying an answer."
)
PatchMethod = Literal["exact", "attribution", "auto"]
PATCH_METHODS: tuple[PatchMethod, ...] = get_args(PatchMethod)
AUTO_ATTRIBUTION_ABOVE = 16_384  # auto: attribution when heads × positions after the first difference exceed this
METHOD_DESCRIPTION = (
    f"exact: every head; attribution: gradients rank, the top patched; auto: attribution past "
    f"{AUTO_ATTRIBUTION_ABOVE:,} heads × positions"
)
CLEAN_DESCRIPTION = "e.g. '… John gave a drink to'"
CORRUPTED_DESCRIPTION = "one fact changed, same token length: '… Mary gave a drink to'"
ANSWER_DESCRIPTION = "the clean answer, one token"
WRONG_DESCRIPTION = "the corrupted answer, one token"


class PatchHeadsInput(ModelInput, StackInput):
    clean: str = Field(description=CLEAN_DESCRIPTION)
    corrupted: str = Field(description=CORRUPTED_DESCRIPTION)
    answer: str | None = Field(default=None, min_length=1, description=ANSWER_DESCRIPTION)
    wrong: str | None = Field(default=None, min_length=1, description=WRONG_DESCRIPTION)
    layers: list[int] | None = None
    top_k: int = Field(default=3, ge=1, le=20, description="heads listed first, and patched position by position")
    per_position: bool = Field(default=True, description="patch the top_k heads one position at a time as well")
    method: PatchMethod = Field(default="auto", description=METHOD_DESCRIPTION)
    grad_drop: bool = Field(
        default=False,
        description="attribution: also choose candidates by GradDrop (one more backward row per layer), for heads "
        "whose direct and indirect effects cancel in the plain estimate",
    )
    saturation_fix: bool = Field(
        default=True,
        description="attribution: AtP*'s fix for saturated attention (the pattern of a head whose softmax is "
        "saturated over the change is recomputed exactly with the clean queries and keys, and the heads upstream "
        "credited through that change instead of the ~0 gradient of the saturated softmax)",
    )
    verify: int = Field(
        default=20,
        ge=1,
        le=200,
        description="attribution: the estimate's top candidates patched exactly (a random sample of as many "
        "again outside them, at most 10, is patched too)",
    )


class HeadPatchResult(HeadRow):
    restored: Rounded = Field(
        description="(LD_patched − LD_corrupted) / (LD_clean − LD_corrupted): the fraction of the logit difference "
        "this head's clean output restores in the corrupted run (1 all, 0 none, < 0 pushes the other way)"
    )
    logit_difference: Rounded = Field(
        description="LD with the head patched: logit(answer) − logit(wrong), last position"
    )
    size: Literal["large", "small"] | None = Field(
        default=None,
        description="against patching one random head (single_head_baseline): large when |restored − mean| > "
        "3 spreads and > 0.05; set for the top heads",
    )
    estimate: Rounded | None = Field(
        default=None, description="attribution's first-order estimate of restored, next to the exact value above"
    )


class Baseline(BaseModel):
    """What patching the same number of random heads restores."""

    mean: Rounded
    spread: Rounded = Field(description="standard deviation over the draws")
    draws: int = Field(description="random draws (seeded, reproducible)")
    heads: int = Field(description="heads patched together in each draw")


class SetPatch(BaseModel):
    """The top heads patched together, against random sets of as many heads."""

    heads: list[str]
    restored: Rounded
    baseline: Baseline
    size: Literal["large", "small"]
    top_token_corrupted: str = Field(description="the corrupted run's top next token")
    top_token_patched: str = Field(description="the top next token with these heads patched")
    change: Literal["unchanged", "flip", "tie"] = Field(
        description="flip: the new top token leads the old one by at least tie_margin in probability; tie: by less"
    )
    p_old: Rounded = Field(description="after patching, the probability of the corrupted run's top token")
    p_new: Rounded = Field(description="after patching, the probability of the new top token")


class LayerPatchResult(BaseModel):
    layer: int
    restored: Rounded = Field(description="the fraction restored by patching every head of the layer at once")


class PositionPatch(BaseModel):
    position: int
    token: str = Field(description="the corrupted prompt's token there")
    restored: Rounded
    estimate: Rounded | None = Field(default=None, description="attribution's estimate there, beside the exact value")


class HeadPositions(HeadRow):
    positions: list[PositionPatch] = Field(
        description="the head patched at one position at a time; positions before the first difference between the "
        "prompts restore exactly 0 (the head's output there is the same in both runs) and are listed without a run"
    )


class LayerEstimate(BaseModel):
    """A layer's attention output and MLP output: attribution estimate beside the exact value (restored fractions)."""

    layer: int
    attention_estimate: Rounded
    attention_exact: float | None = Field(default=None, description="every head of the layer patched at once")
    mlp_estimate: Rounded | None = Field(
        default=None, description="set only for the MLPs patched exactly (the 3 largest |estimates|)"
    )
    mlp_exact: Rounded | None = Field(default=None, description="the layer's whole MLP output patched")


class AttributionCheck(BaseModel):
    """Attribution patching verified by exact patching: every number here was patched exactly unless named estimate."""

    estimated: int = Field(description="heads estimated (one clean pass, one corrupted pass with a backward)")
    verified_top: int = Field(description="the estimate's top candidates patched exactly")
    verified_random: int = Field(description="heads drawn at random outside them and patched exactly")
    spearman: Rounded | None = Field(description="rank agreement of |estimate| and |exact| over the verified heads")
    recall: int = Field(description="of the exact top k among verified heads, how many the estimate's top k holds")
    k: int = Field(description="top_k, or fewer when fewer candidates were verified")
    missed: HeadPatchResult | None = Field(
        description="the largest exact effect outside the estimate's top candidates (what the estimate may have missed)"
    )
    grad_drop: bool = Field(description="candidates also chosen by GradDrop (Kramár et al. 2024)")
    saturated: list[str] | None = Field(
        default=None,
        description="AtP*: the heads whose saturated softmax was recomputed exactly with the clean queries and keys "
        "(None: the fix was off)",
    )
    gradient_dtype: str = Field(
        description="precision of the backward: the model's dtype (float16 with a loss scale), sums in float64"
    )
    layers: list[LayerEstimate] = Field(default_factory=list)
    forward_equivalents: float = Field(description="passes the estimate cost, in forwards (backward ≈ 2)")


class PatchReport(Report, StackReport):
    tokens: int = Field(description="tokens in each prompt")
    first_difference: int = Field(description="first position where the prompts' tokens differ")
    differing_positions: list[int]
    answer: str
    answer_id: int
    wrong: str
    wrong_id: int
    logit_difference_clean: Rounded = Field(
        description="logit(answer) − logit(wrong) at the clean prompt's last position"
    )
    logit_difference_corrupted: Rounded
    gap_threshold: Rounded = Field(
        description="the smallest |LD_clean − LD_corrupted| accepted: 0.25 × the standard deviation of the clean "
        "run's next-token logits (a smaller gap would turn ordinary head noise into hundreds of percent)"
    )
    method: Literal["exact", "attribution"] = Field(description="how the heads were ranked (see attribution)")
    single_head_baseline: Baseline = Field(
        description="restored by one random head: every patched head outside the top_k (exact; with attribution, "
        "the random sample patched exactly)"
    )
    top_set: SetPatch | None = Field(default=None, description="the top_k heads patched together vs random sets")
    tie_margin: float = Field(description="probability margin below which a top-token change is a tie")
    direction: str = Field(description="what is copied where")
    layers: list[int]
    top_heads: list[HeadPatchResult] = Field(description="the top_k heads by |restored|, largest first")
    heads: list[HeadPatchResult] = Field(description="every patched head, in layer and head order")
    layer_results: list[LayerPatchResult]
    positions: list[HeadPositions] = Field(default_factory=list, description="per position, for the top heads")
    attribution: AttributionCheck | None = Field(
        default=None, description="with method attribution: how the estimate did against exact patching"
    )
    patched_runs: int = Field(description="patched variants run (rows of the batched forwards)")
