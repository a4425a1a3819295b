"""plan_kv_cache's arguments and report."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, Field

from agent_tools.schemas import Report, Rounded, Rounded6, TextInput

DESCRIPTION = (
    "Which KV heads can keep only the first `sink` + last `window` tokens: loss change per head, a verified plan "
    "under a loss budget. Use to plan a short KV cache."
)

Precision = Literal["float32", "bfloat16", "float16", "fp8", "int8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)


class PlanKvCacheInput(TextInput):
    sink: int = Field(default=4, description="first tokens every head keeps")
    window: int = Field(default=64, description="last tokens a short-cache head keeps")
    loss_budget: float = Field(default=0.02, description="allowed rise of the mean loss, nats, over the plan")
    tolerance: float | None = Field(
        default=None,
        description="a group joins when its verified loss change is within this of the prediction, nats; "
        "omitted = loss_budget / 2",
    )
    context_length: int | None = Field(default=None, description="for the memory saving; omitted = the model's limit")
    precision: Precision = Field(default="bfloat16", description="of the KV cache")
    layers: list[int] | None = Field(default=None, description="layers allowed a short cache")


class KvHeadEffect(BaseModel):
    layer: int
    kv_head: int
    query_heads: list[int] = Field(description="query heads sharing this KV head (restricted together)")
    loss_change: Rounded6 = Field(description="mean next-token loss change when restricted, nats (> 0: hurts)")
    top_token_agreement: Rounded = Field(description="share of scored positions whose top next token is unchanged")
    planned: bool = Field(description="given the short cache by the plan")


class PlanStepRun(BaseModel):
    added_kv_heads: int = Field(description="KV heads tried in this run on top of the plan accepted before it")
    predicted_loss_change: Rounded6 = Field(description="the plan's verified change before + Σ of the added heads' own")
    verified_loss_change: Rounded6 = Field(description="measured with the plan and the added heads restricted at once")
    accepted: bool = Field(description="within the budget and within the tolerance of the prediction")


class PlanCheck(BaseModel):
    planned_kv_heads: int
    total_kv_heads: int = Field(description="KV heads of the whole model")
    predicted_loss_change: Rounded6 = Field(
        description="the last accepted step's prediction: the plan's verified change before it + Σ of the heads it "
        "added (their own changes), nats"
    )
    verified_loss_change: Rounded6 = Field(description="loss change with every planned head restricted at once, nats")
    tolerance: Rounded6 = Field(description="|verified − predicted| every accepted step kept within, nats")
    additive_loss_change: Rounded6 = Field(
        description="Σ of the planned heads' own loss changes (the prediction if single-head effects added up)"
    )
    additive_kv_heads: int = Field(description="heads a plan adding single-head effects would choose")
    additive_verified_loss_change: Rounded6 = Field(
        description="that additive plan's loss change run at once (the first verifying run; 0 when empty)"
    )
    verified_top_token_agreement: Rounded = Field(description="share of scored positions with the same top token")
    loss_full: Rounded = Field(description="mean next-token loss over the scored positions, full cache, nats")
    loss_planned: Rounded = Field(description="the same with the plan applied")
    steps: list[PlanStepRun] = Field(description="the verifying runs in order (groups halve on rejection)")


class MemorySaving(BaseModel):
    context_length: int
    precision: Precision
    full_kv_bytes: int = Field(description="layers × kv_heads × head_dim × 2 × bytes × context_length")
    planned_kv_bytes: int = Field(description="the KV cache with the planned heads keeping sink + window tokens")
    saved_bytes: int
    saved_fraction: Rounded


class PlanKvCacheReport(Report):
    tokens: int
    sink: int
    window: int
    scored_positions: int = Field(
        description="predictions whose query lies past sink + window (the only ones affected)"
    )
    unit: str = Field(description="what is planned: KV heads (a KV head is shared by its query heads)")
    loss_budget: float
    layers: list[int] = Field(description="layers whose KV heads were measured and could be planned")
    heads: list[KvHeadEffect] = Field(description="every measured KV head, in layer order")
    plan: PlanCheck
    memory: MemorySaving
    masked_passes: int = Field(
        description="masked forwards run: one per layer group to measure every KV head (rows of a batch), then one "
        "single-row run per plan step"
    )
    measured_on: str = Field(description="what the plan was measured on: it holds for texts like it, not in general")
