"""plan_kv_cache's arguments and report."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, Field

from agent_tools.schemas import NextCall, Report, Rounded, Rounded6, TextInput

DESCRIPTION = (
    "Which KV heads could keep only the first `sink` + last `window` tokens? Loss change per head by exact masking, "
    "a greedy plan under a loss budget, verified in one run. Use to plan a short KV cache."
)

Precision = Literal["float32", "bfloat16", "float16", "fp8", "int8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)


class PlanKvCacheInput(TextInput):
    sink: int = Field(default=4, description="first tokens every head keeps (attention sinks)")
    window: int = Field(default=64, description="most recent tokens a short-cache head keeps (itself included)")
    loss_budget: float = Field(
        default=0.02, description="allowed rise of the mean next-token loss, nats, summed over planned heads"
    )
    context_length: int | None = Field(
        default=None, description="tokens the memory saving is stated for; omitted = the model's limit"
    )
    precision: Precision = Field(default="bfloat16", description="KV cache number format for the memory saving")
    layers: list[int] | None = Field(
        default=None, description="layers whose heads may get the short cache; omitted = all (the others keep it full)"
    )


class KvHeadEffect(BaseModel):
    layer: int
    kv_head: int
    query_heads: list[int] = Field(description="query heads sharing this KV head (restricted together)")
    loss_change: Rounded6 = Field(description="mean next-token loss change when restricted, nats (> 0: hurts)")
    top_token_agreement: Rounded = Field(description="share of scored positions whose top next token is unchanged")
    planned: bool = Field(description="given the short cache by the plan")


class PlanCheck(BaseModel):
    planned_kv_heads: int
    total_kv_heads: int = Field(description="KV heads of the whole model")
    predicted_loss_change: Rounded6 = Field(description="Σ of the planned heads' own loss changes, nats")
    additive_kv_heads: int = Field(description="heads the additive greedy plan chose before verification")
    additive_verified_loss_change: Rounded6 = Field(
        description="its loss change run at once; over the budget, the plan was cut back to the longest prefix fitting"
    )
    verified_loss_change: Rounded6 = Field(description="loss change with every planned head restricted at once, nats")
    verified_top_token_agreement: Rounded = Field(description="share of scored positions with the same top token")
    loss_full: Rounded = Field(description="mean next-token loss over the scored positions, full cache, nats")
    loss_planned: Rounded = Field(description="the same with the plan applied")


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
        description="masked forwards run: one per layer group to measure every KV head, then the verifying runs"
    )
    measured_on: str = Field(description="what the plan was measured on: it holds for texts like it, not in general")
    next_calls: list[NextCall] = Field(default_factory=list, description="calls that would confirm or refute the lead")
