"""diagnose_collapse's arguments and report: the pydantic models an agent reads, with their descriptions."""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent_tools.analysis.ablation import BASELINE_DRAWS, EFFECT_FLOOR, Direction
from agent_tools.analysis.collapse import (
    CONCENTRATED_MEAN_MAX,
    CONCENTRATED_SATURATED,
    MAX_CHECKED_HEADS,
    NO_OP_CONTRIBUTION,
    CollapseKind,
    Concentration,
    Verdict,
)
from agent_tools.analysis.metrics import BASELINE_SIGMAS, SATURATION
from agent_tools.schemas import HeadRow, Report, Rounded, Rounded6, TextInput
from agent_tools.stack_input import StackInput, StackReport

DESCRIPTION = (
    "Heads that collapse (max weight near 1), onto which token, and what removing each does vs random heads "
    "(sink, load-bearing, harmful). Use when attention looks stuck."
)


class DiagnoseCollapseInput(TextInput, StackInput):
    layers: list[int] | None = None
    heads: list[int] | None = None
    threshold: float = Field(
        default=SATURATION, gt=0.0, le=1.0, description="a row is saturated when its max weight is at or above this"
    )
    top_k: int = Field(default=10, ge=1, le=2000, description="heads listed")
    png: bool = Field(default=False, description="write a layer × head PNG (artifact)")
    causal_check: bool = Field(default=True, description="ablate each collapsed head vs random heads")
    resample_text: str | None = Field(default=None, min_length=1)
    max_checked: int = Field(
        default=MAX_CHECKED_HEADS, ge=1, le=32, description="collapsed heads checked at most, most collapsed first"
    )
    baseline_draws: int = Field(
        default=BASELINE_DRAWS, ge=2, le=64, description="random non-collapsed heads ablated for the baseline"
    )
    seed: int = Field(default=0, ge=0, description="seeds the baseline's draws and the resample shuffle")


class HeadCollapseRow(HeadRow):
    kv_head: int = Field(description="the KV head this query head reads (grouped-query attention)")
    verdict: Verdict = Field(
        description=(
            "value side only (what the dominant key writes, not whether it matters: see kind): no_op_sink: "
            "concentrated on one key whose value contributes little; writing_collapse: concentrated on one key "
            "whose value is substantial, so it writes about the same vector at every position; positional: "
            "concentrated on self/previous token; query_dependent: sharp but the chosen key changes with the "
            "query; not_collapsed"
        )
    )
    kind: CollapseKind | None = Field(
        default=None,
        description="what removing the head did (see checks); None: not checked",
    )
    concentration: Concentration = Field(description="where most rows put their largest weight")
    mean_entropy: Rounded = Field(description="mean row entropy, nats")
    mean_normalised_entropy: Rounded = Field(
        description="mean of entropy / log(keys the row may see): 0 one key, 1 flat"
    )
    mean_max_weight: Rounded
    saturated_fraction: Rounded = Field(description="fraction of rows whose max weight ≥ threshold")
    dominant_position: int = Field(description="key with the largest mean weight over rows")
    dominant_token: str
    dominant_share: Rounded = Field(description="mean weight the dominant key receives")
    dominant_argmax_fraction: Rounded = Field(description="fraction of rows whose argmax is the dominant key")
    sink_fraction: Rounded = Field(description="fraction of rows whose argmax is the first token or a special token")
    self_fraction: Rounded
    previous_fraction: Rounded
    top_other_position: int | None = Field(description="most frequent argmax among non-sink keys")
    top_other_token: str | None
    top_other_fraction: Rounded
    dominant_value_norm: Rounded | None = Field(description="‖v_j W_O^h‖ of the dominant key")
    other_value_norm: Rounded | None = Field(description="mean ‖v_j W_O^h‖ of the other keys")
    value_norm_ratio: Rounded | None = Field(description="dominant / other value norm")
    dominant_value_share: Rounded | None = Field(
        description="mean share of Σ_j ‖α_ij v_j W_O^h‖ the dominant key supplies (norm-based analysis)"
    )
    dominant_contribution: Rounded | None = Field(
        description="mean_i ‖α_ij v_j W_O^h‖ of the dominant key: the norm of what it actually writes"
    )
    contribution_ratio: Rounded | None = Field(
        description=(
            f"dominant_contribution / other_value_norm; below {NO_OP_CONTRIBUTION} the dominant key writes less "
            "than half of what reading an ordinary key would, so a head concentrated on it is a no-op sink"
        )
    )
    mean_output_norm: Rounded | None = Field(description="mean ‖Σ_j α_ij v_j W_O^h‖: what the head writes per row")
    mean_centred_score_norm: Rounded = Field(description="mean r = ‖z − mean z‖ of the pre-mask scores per row")
    mean_entropy_bound: Rounded = Field(description="mean Zhai et al. entropy lower bound from r, nats")
    min_bound_slack: Rounded6 = Field(description="min over rows of entropy − bound (≥ 0 up to rounding)")
    rows: int = Field(description="query rows counted (rows that see ≥ 2 keys)")


class AblationEffectRow(BaseModel):
    """One ablation's effect and how it compares with the same ablation on random heads."""

    effect: Rounded6 = Field(
        description="Δ mean next-token loss when removed (ablated − clean, nats; encoder: 1 − cos)"
    )
    direction: Direction = Field(description="raises / lowers the loss beyond the baseline's spread, or within it")


class CollapseCheckRow(HeadRow):
    verdict: Verdict = Field(description="value side (see heads)")
    kind: CollapseKind = Field(
        description=(
            "no_op_sink: writes almost nothing and removing it changes nothing beyond chance; constant_output: "
            "writes a large but input-independent vector (a learned bias), removing it changes nothing beyond "
            "chance; load_bearing: removing it raises the loss beyond chance; harmful: removing it lowers the loss "
            "beyond chance; mixed: one ablation raises, the other lowers"
        )
    )
    mean_ablation: AblationEffectRow = Field(description="output replaced by its mean over the text's positions")
    resample_ablation: AblationEffectRow | None = Field(
        default=None, description="output taken from the resample source at the same position"
    )


class GroupCheckRow(BaseModel):
    """Every checked head removed at once."""

    heads: list[str] = Field(description='the heads removed together, "L.H"')
    mean_ablation: AblationEffectRow
    resample_ablation: AblationEffectRow | None = None


class BaselineRow(BaseModel):
    """The same ablation on random heads: mean ± sample standard deviation over the draws."""

    draws: int
    heads_per_draw: int
    mean_ablation: tuple[Rounded6, Rounded6] = Field(description="(mean, sd) of Δ loss, mean-ablation")
    resample_ablation: tuple[Rounded6, Rounded6] | None = Field(
        default=None, description="(mean, sd), resample-ablation"
    )


class CollapseCheck(BaseModel):
    measure: str = Field(description="next_token_loss (causal LM) or embedding_cosine (encoder)")
    loss_clean: Rounded | None = Field(default=None, description="mean next-token loss on the text, nats")
    collapsed: int = Field(description="collapsed heads (no_op_sink or writing_collapse)")
    checked: int = Field(description="how many of them were checked (max_checked, most collapsed first)")
    rule: str = Field(description="when an effect counts as beyond chance")
    resample_source: str = Field(description="what resample-ablation copied head outputs from")
    baseline: BaselineRow | None = Field(
        default=None, description="single random heads drawn from the examined heads that did not collapse, seeded"
    )
    together: GroupCheckRow | None = Field(default=None, description="every checked head removed at once")
    together_baseline: BaselineRow | None = Field(default=None, description="as many random heads at once")
    heads: list[CollapseCheckRow]
    forward_equivalents: float = Field(description="cost of the check in forward passes of the text")
    notes: list[str] = Field(default_factory=list)


BEYOND_RULE = (
    f"beyond chance: more than max({BASELINE_SIGMAS:g} × the baseline's sd, {EFFECT_FLOOR:g}) from the "
    f"baseline's mean and more than {EFFECT_FLOOR:g} from 0"
)


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
    check: CollapseCheck | None = Field(
        default=None, description="what removing the collapsed heads does, against random heads (causal_check)"
    )
    png_path: str | None = None
