"""profile_heads' arguments and report: the pydantic models an agent reads, with their descriptions."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from agent_tools.analysis.heads import (
    DEFAULT_LOCAL_WINDOW,
    DEFAULT_SKIP_CAUSAL,
    DEFAULT_THRESHOLDS,
    HEAD_ROLES,
    HeadRole,
)
from agent_tools.probes import DEFAULT_PROBE_LENGTH
from agent_tools.prompt_trace import NextCall
from agent_tools.schemas import ModelInput, Report, ToolInput
from agent_tools.stack_input import StackInput, StackReport

DESCRIPTION = (
    "The role of every head (previous_token, induction, duplicate_token, first_token, self, local, broad, ...) "
    "scored against uniform attention, top heads per role with ablation evidence. Use to find heads of a kind."
)
SAMPLE_TEXT = (
    "The cat sat on the mat because it was tired, and the dog watched it from the door. "
    "When the rain stopped, they both went outside: the cat first, then the dog."
)

Threshold = Annotated[float, Field(gt=0, lt=1)]
MeasuredOn = Literal["text", "probe"]
TextSource = Literal["user", "sample"]
EvidenceMetric = Literal["second_copy_loss_change", "mean_next_token_kl", "pooled_cosine_change"]


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
        description="text for the text roles; omitted = a sample (induction uses random-token probes)",
    )
    layers: list[int] | None = Field(default=None, description="omitted = all")
    roles: list[HeadRole] | None = Field(default=None, description="omitted = all")
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
        "ablated",
    )
    ablate_top: int | None = Field(
        default=None,
        ge=0,
        le=5,
        description="ablation evidence for each role's top N heads; 0 = off; omitted = where cheap (probe roles)",
    )


class HeadProfile(BaseModel):
    layer: int
    head: int
    kv_head: int
    scores: dict[HeadRole, float] = Field(description="every measurable role's score in [0, 1]")
    primary_role: HeadRole | None = Field(
        description="the qualifying role furthest past its threshold, specific roles before the fallbacks first_token "
        "and broad (what a head does when its pattern is absent); None = no role reaches its threshold"
    )
    confidence: float = Field(description="(score − threshold) / (1 − threshold) of the primary role, 0..1")
    runner_up: HeadRole | None = None
    runner_up_score: float | None = None
    score_spread: dict[HeadRole, float] = Field(
        default_factory=dict, description="probe roles: standard deviation of the score over the probe seeds"
    )


class AblationEvidence(BaseModel):
    metric: EvidenceMetric = Field(
        description="probe roles on an LM: change in loss on the second copy (nats); text roles on an LM: KL of the "
        "next-token distribution averaged over positions; encoders: 1 − cos of the mean-pooled embedding"
    )
    value: float


class TopHead(BaseModel):
    layer: int
    head: int
    score: float
    qualifies: bool = Field(description="score ≥ the role's threshold")
    primary_role: HeadRole | None
    ablation: AblationEvidence | None = None
    spread: float | None = Field(default=None, description="probe roles: standard deviation over the probe seeds")


class RoleReport(BaseModel):
    role: HeadRole
    formula: str
    measured_on: MeasuredOn
    threshold: float
    uniform_baseline: float | None = Field(
        default=None,
        description="the score a head attending uniformly (over the keys each query may read) gets on the same input",
    )
    heads_with_role: int = Field(description="heads whose score reaches the threshold")
    primary_for: int = Field(description="heads whose primary role this is")
    top: list[TopHead]


class ProbeInfo(BaseModel):
    seed: int
    seeds: list[int] = Field(default_factory=list, description="every probe's seed (scores are their mean)")
    repeat_length: int = Field(description="N random tokens per copy")
    length: int = Field(description="probe tokens in all (prefix + 2N + suffix)")
    first_copy_start: int
    preview: list[str] = Field(description="the probe's first tokens")


class InductionCheck(BaseModel):
    loss_first_copy: float = Field(description="mean next-token loss on the first copy (random tokens), nats")
    loss_second_copy: float = Field(description="the same on the second copy; far lower = the model copies")
    ablated_heads: list[str] = Field(description="top induction heads removed together (zero ablation)")
    loss_second_copy_ablated: float | None = Field(default=None, description="second-copy loss with them removed")


class HeadProfiles(Report, StackReport):
    layers: list[int]
    num_heads: int
    text_source: TextSource
    text_tokens: int | None
    probe: ProbeInfo | None
    thresholds: dict[HeadRole, float]
    unmeasured: dict[HeadRole, str] = Field(default_factory=dict, description="roles that could not be scored, why")
    roles: list[RoleReport]
    induction_check: InductionCheck | None = None
    heads: list[HeadProfile]
    next_calls: list[NextCall] = Field(default_factory=list, description="calls that would confirm or refute the lead")
