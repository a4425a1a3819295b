"""diagnose_collapse's arguments and report: the pydantic models an agent reads, with their descriptions."""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent_tools.analysis.collapse import (
    CONCENTRATED_MEAN_MAX,
    CONCENTRATED_SATURATED,
    NO_OP_CONTRIBUTION,
    Concentration,
    Verdict,
)
from agent_tools.schemas import Report, TextInput
from agent_tools.stack_input import StackInput, StackReport

DESCRIPTION = (
    "Find heads that collapse (max weight near 1) on a text, onto which token, and whether harmlessly (a no-op "
    "sink that writes little) or harmfully. Use when attention looks stuck or to find sinks."
)


class DiagnoseCollapseInput(TextInput, StackInput):
    layers: list[int] | None = Field(default=None, description="omitted = all")
    heads: list[int] | None = Field(default=None, description="omitted = all")
    threshold: float = Field(
        default=0.99, gt=0.0, le=1.0, description="a row is saturated when its max weight is at or above this"
    )
    top_k: int = Field(default=10, ge=1, le=2000, description="heads listed, most collapsed first")
    png: bool = Field(default=False, description="write a layer × head PNG (artifact)")


class HeadCollapseRow(BaseModel):
    layer: int
    head: int
    kv_head: int = Field(description="the KV head this query head reads (grouped-query attention)")
    verdict: Verdict = Field(
        description=(
            "no_op_sink: concentrated on one key whose value contributes little (harmless); harmful_collapse: "
            "concentrated on one key whose value dominates the output regardless of the query; positional: "
            "concentrated on self/previous token; query_dependent: sharp but the chosen key changes with the "
            "query; not_collapsed"
        )
    )
    concentration: Concentration = Field(description="where most rows put their largest weight")
    mean_entropy: float = Field(description="mean row entropy, nats")
    mean_normalised_entropy: float = Field(description="mean of entropy / log(keys the row may see): 0 one key, 1 flat")
    mean_max_weight: float
    saturated_fraction: float = Field(description="fraction of rows whose max weight ≥ threshold")
    dominant_position: int = Field(description="key with the largest mean weight over rows")
    dominant_token: str
    dominant_share: float = Field(description="mean weight the dominant key receives")
    dominant_argmax_fraction: float = Field(description="fraction of rows whose argmax is the dominant key")
    sink_fraction: float = Field(description="fraction of rows whose argmax is the first token or a special token")
    self_fraction: float
    previous_fraction: float
    top_other_position: int | None = Field(description="most frequent argmax among non-sink keys")
    top_other_token: str | None
    top_other_fraction: float
    dominant_value_norm: float | None = Field(description="‖v_j W_O^h‖ of the dominant key")
    other_value_norm: float | None = Field(description="mean ‖v_j W_O^h‖ of the other keys")
    value_norm_ratio: float | None = Field(description="dominant / other value norm")
    dominant_value_share: float | None = Field(
        description="mean share of Σ_j ‖α_ij v_j W_O^h‖ the dominant key supplies (norm-based analysis)"
    )
    dominant_contribution: float | None = Field(
        description="mean_i ‖α_ij v_j W_O^h‖ of the dominant key: the norm of what it actually writes"
    )
    contribution_ratio: float | None = Field(
        description=(
            f"dominant_contribution / other_value_norm; below {NO_OP_CONTRIBUTION} the dominant key writes less "
            "than half of what reading an ordinary key would, so a head concentrated on it is a no-op sink"
        )
    )
    mean_output_norm: float | None = Field(description="mean ‖Σ_j α_ij v_j W_O^h‖: what the head writes per row")
    mean_centred_score_norm: float = Field(description="mean r = ‖z − mean z‖ of the pre-mask scores per row")
    mean_entropy_bound: float = Field(description="mean Zhai et al. entropy lower bound from r, nats")
    min_bound_slack: float = Field(description="min over rows of entropy − bound (≥ 0 up to rounding)")
    rows: int = Field(description="query rows counted (rows that see ≥ 2 keys)")


class CollapseReport(Report, StackReport):
    num_tokens: int
    threshold: float
    heads_examined: int
    concentrated_heads: int = Field(
        description=(
            f"heads with mean max weight ≥ {CONCENTRATED_MEAN_MAX} or ≥ {CONCENTRATED_SATURATED:.0%} of rows saturated"
        )
    )
    verdict_counts: dict[str, int]
    sink_positions: list[int] = Field(description="positions treated as sinks: the first token and special tokens")
    bound_violations: int = Field(description="rows whose entropy fell below the Zhai et al. bound (should be 0)")
    heads: list[HeadCollapseRow] = Field(description="most collapsed first, top_k of them")
    png_path: str | None = None
