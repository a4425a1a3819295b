"""profile_heads' arguments and report: the pydantic models an agent reads, with their descriptions."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from agent_tools.analysis.heads import (
    ABLATION_CHECK_FORMULAS,
    DEFAULT_LOCAL_WINDOW,
    DEFAULT_SKIP_CAUSAL,
    DEFAULT_THRESHOLDS,
    HEAD_ROLES,
    AblationCheck,
    HeadRole,
    MeasuredOn,
    PatternName,
    RoleVerdict,
)
from agent_tools.probes import DEFAULT_PROBE_LENGTH
from agent_tools.schemas import HeadRow, ModelInput, Report, Rounded, Rounded6, ToolInput
from agent_tools.stack_input import StackInput, StackReport

DESCRIPTION = (
    "Every head's role (previous_token, induction, …) over several texts, top heads per role "
    "checked by ablation vs random heads. Use to find heads of a kind."
)
SAMPLE_TEXT = (
    "The cat sat on the mat because it was tired, and the dog watched it from the door. "
    "When the rain stopped, they both went outside: the cat first, then the dog."
)

# Held-out texts for the text roles' spread: short (under 40 tokens for word-level and BPE tokenizers), in three
# registers, none sharing a sentence with the sample.
HELD_OUT_TEXTS = (
    "On Monday the committee met to discuss the budget, and several members argued that the old library needed "
    "more money.",
    "She opened the letter slowly, read it twice, and laughed; her brother, waiting by the window, asked her why.",
    "Water boils at a lower temperature in the mountains, because the air pressure there is lower than at sea level.",
)
Threshold = Annotated[float, Field(gt=0, lt=1)]
TextSource = Literal["user", "sample"]
EvidenceMetric = Literal["second_copy_loss_change", "next_token_loss_change", "pooled_cosine_change"]


class RoleThresholds(ToolInput):
    """Thresholds by role: an object with one optional property per role (not a map, so that every provider's
    function-calling schema can state it; the same JSON as ``{role: threshold}``)."""

    previous_token: Threshold | None = None
    induction: Threshold | None = None
    duplicate_token: Threshold | None = None
    first_token: Threshold | None = None
    self: Threshold | None = None
    local: Threshold | None = None
    broad: Threshold | None = None
    next_token: Threshold | None = None
    special_token: Threshold | None = None
    punctuation: Threshold | None = None

    def given(self) -> dict[HeadRole, float]:
        """The thresholds the caller set, by role."""
        return {role: value for role in HEAD_ROLES if (value := getattr(self, role)) is not None}


class ProfileHeadsInput(ModelInput, StackInput):
    text: str | None = Field(
        default=None,
        description="omitted = a sample (induction uses random-token probes)",
    )
    layers: list[int] | None = None
    roles: list[HeadRole] | None = None
    seed: int = Field(default=0, ge=0, description="seed of the first probe's random tokens (same seed, same probe)")
    seeds: int = Field(
        default=3,
        ge=1,
        le=10,
        description="probes of random tokens (seeds seed, seed+1, …) whose induction / duplicate_token scores are "
        "averaged, with their spread: rankings vary from probe to probe",
    )
    probe_length: int | None = Field(
        default=None,
        ge=4,
        le=512,
        description=f"N: random tokens per copy; the probe is [BOS] + N tokens + the same N; omitted = "
        f"{DEFAULT_PROBE_LENGTH}, or as many as the model's positions allow",
    )
    held_out_texts: int = Field(
        default=2,
        ge=0,
        le=len(HELD_OUT_TEXTS),
        description="built-in held-out texts scored besides the text (or the sample): the text roles' top heads "
        "are ranked by their mean score over all these texts, with the spread; 0 = the text alone",
    )
    patterns: list[PatternName] | None = Field(
        default=None,
        description="query×key patterns scored like roles",
    )
    top_k: int = Field(default=3, ge=1, le=20, description="top heads listed per role")
    thresholds: RoleThresholds | None = Field(
        default=None,
        description='per-role score in (0, 1) a head needs to take the role, e.g. {"induction": 0.2}; omitted '
        "roles keep their defaults: " + ", ".join(f"{r} {t}" for r, t in DEFAULT_THRESHOLDS.items()),
    )
    skip_queries: int | None = Field(
        default=None,
        ge=0,
        description=f"queries before this position are not scored; omitted = {DEFAULT_SKIP_CAUSAL} for causal models "
        "(early rows see only 1–2 keys), 0 for encoders",
    )
    local_window: int = Field(
        default=DEFAULT_LOCAL_WINDOW, ge=2, le=64, description="local = keys 2..local_window positions away"
    )
    induction_check: bool = Field(
        default=True,
        description="causal LMs: loss on the probe's second copy vs the first, and with the top induction heads "
        "mean-ablated together vs as many random heads",
    )
    ablate_top: int | None = Field(
        default=None,
        ge=0,
        le=5,
        description="mean-ablation evidence for each role's top N heads against random heads; 0 = off; omitted = "
        "the listed heads of roles with an ablation check (previous_token, induction), none of the others",
    )
    baseline_draws: int = Field(
        default=8,
        ge=2,
        le=32,
        description="random heads (random sets, for the joint induction check) mean-ablated the same way as the "
        "baseline; fewer when the model has fewer other heads",
    )


class HeadProfile(HeadRow):
    kv_head: int
    scores: dict[HeadRole, Rounded] = Field(description="every measurable role's score in [0, 1]")
    primary_role: HeadRole | None = Field(
        description="the qualifying role furthest past its threshold, specific roles before the fallbacks first_token "
        "and broad (what a head does when its pattern is absent); None = no role reaches its threshold"
    )
    confidence: Rounded = Field(description="(score − threshold) / (1 − threshold) of the primary role, 0..1")
    runner_up: HeadRole | None = None
    runner_up_score: Rounded | None = None
    score_spread: dict[HeadRole, Rounded] = Field(
        default_factory=dict, description="probe roles: standard deviation of the score over the probe seeds"
    )
    # text roles' scores are on the text (or the sample); the role tables' top heads give their mean over texts


class AblationEvidence(BaseModel):
    metric: EvidenceMetric = Field(
        description="with the head mean-ablated (output replaced by its mean over the input's positions): change in "
        "next-token loss on the probe's second copy (previous_token, probe roles) or over the text (other text "
        "roles), nats, + = the loss rises; encoders: 1 − cos of the mean-pooled embedding"
    )
    value: Rounded6
    baseline_mean: Rounded6 | None = Field(default=None, description="the same on random single heads: mean")
    baseline_spread: Rounded6 | None = Field(default=None, description="… and sample standard deviation (n − 1)")
    baseline_draws: int = Field(default=0, description="random heads drawn (other than the tested heads)")
    exceeds_baseline: bool = Field(
        default=False, description="value > baseline mean + max(2 × spread, a floor): it matters more than chance"
    )


class TopHead(HeadRow):
    score: Rounded = Field(description="mean over the role's inputs (texts or probe seeds; see the role's inputs)")
    spread: Rounded | None = Field(default=None, description="population standard deviation over those inputs")
    score_on_text: Rounded | None = Field(default=None, description="text roles: the score on the text alone")
    qualifies: bool = Field(description="score ≥ the role's threshold")
    primary_role: HeadRole | None
    ablation: AblationEvidence | None = None
    verdict: RoleVerdict = Field(
        description="is_role: qualifies and its ablation check beats random heads; attends_only: qualifies, "
        "but removing it changes no more than removing random heads; unchecked: qualifies, no ablation check "
        "ran; below_threshold"
    )


class RoleReport(BaseModel):
    role: HeadRole
    formula: str
    measured_on: MeasuredOn
    inputs: int = Field(description="texts (the text + held-out texts) or probes the top heads' mean is over")
    ablation_check: AblationCheck | None = Field(
        description="what removing a head of this role should change (None: the role predicts no effect to test): "
        + "; ".join(f"{name}: {formula}" for name, formula in ABLATION_CHECK_FORMULAS.items())
    )
    threshold: float
    uniform_baseline: Rounded | None = Field(
        default=None,
        description="the score a head attending uniformly (over the keys each query may read) gets on the same input",
    )
    heads_with_role: int = Field(description="heads whose score reaches the threshold")
    primary_for: int = Field(description="heads whose primary role this is")
    top: list[TopHead]


class PatternTop(HeadRow):
    score: Rounded = Field(description="mean over the texts")
    spread: Rounded | None = Field(default=None, description="population standard deviation over the texts")
    score_on_text: Rounded | None = Field(default=None, description="the score on the text alone")


class PatternReport(BaseModel):
    name: PatternName
    formula: str
    inputs: int = Field(description="texts the pattern had a key on (the mean is over these)")
    uniform_baseline: Rounded | None = Field(default=None, description="a uniform head's score on the text")
    top: list[PatternTop]


class ProbeInfo(BaseModel):
    seed: int
    seeds: list[int] = Field(default_factory=list, description="every probe's seed (scores are their mean)")
    repeat_length: int = Field(description="N random tokens per copy")
    length: int = Field(description="probe tokens in all (prefix + 2N + suffix)")
    first_copy_start: int
    preview: list[str] = Field(description="the probe's first tokens")


class InductionCheck(BaseModel):
    loss_first_copy: Rounded = Field(description="mean next-token loss on the first copy (random tokens), nats")
    loss_second_copy: Rounded = Field(description="the same on the second copy; far lower = the model copies")
    ablated_heads: list[str] = Field(description="top induction heads mean-ablated together")
    loss_second_copy_ablated: Rounded | None = Field(default=None, description="second-copy loss with them removed")
    baseline_mean: Rounded | None = Field(
        default=None, description="second-copy loss with as many random heads mean-ablated together: mean"
    )
    baseline_spread: Rounded | None = Field(default=None, description="… and sample standard deviation (n − 1)")
    baseline_draws: int = Field(default=0, description="random sets drawn")
    exceeds_baseline: bool = Field(default=False, description="the rise beats the random sets' (mean + 2 × spread)")


class HeadProfiles(Report, StackReport):
    layers: list[int]
    num_heads: int
    text_source: TextSource
    text_tokens: int | None
    held_out_texts: int = Field(default=0, description="built-in held-out texts scored besides the text")
    probe: ProbeInfo | None
    thresholds: dict[HeadRole, float]
    unmeasured: dict[HeadRole, str] = Field(default_factory=dict, description="roles that could not be scored, why")
    roles: list[RoleReport]
    induction_check: InductionCheck | None = None
    patterns: list[PatternReport] = Field(default_factory=list, description="named patterns asked for")
    heads: list[HeadProfile]
