"""diagnose_collapse: which heads collapse, onto which token, and is it a harmless sink?"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, Field

from agent_tools.analysis.collapse import (
    CONCENTRATED_MEAN_MAX,
    CONCENTRATED_SATURATED,
    NO_OP_CONTRIBUTION,
    CollapseConsumer,
    Concentration,
    HeadCollapse,
    Verdict,
    output_grams_for,
    rank_heads,
)
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Encoded, Inspector, PassPlan, check_indices, text_digest
from agent_tools.loading import LoadedModel
from agent_tools.render import grid_heatmap
from agent_tools.schemas import Finding, Report, TextInput, rounded
from agent_tools.tools.registry import ToolSpec


class DiagnoseCollapseInput(TextInput):
    layers: list[int] | None = Field(default=None, description="layers to examine, 0-based; omitted = all layers")
    heads: list[int] | None = Field(default=None, description="query heads to examine in each layer; omitted = all")
    threshold: float = Field(
        default=0.99, gt=0.0, le=1.0, description="a row is saturated when its max weight is at or above this"
    )
    top_k: int = Field(default=10, ge=1, le=2000, description="heads listed in the report, most collapsed first")
    png: bool = Field(default=False, description="write a layer × head grid of mean max weight as a PNG artifact")


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


class CollapseReport(Report):
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


def _row(stats: HeadCollapse, tokens, kv_head: int) -> HeadCollapseRow:
    def opt(value: float | None) -> float | None:
        return None if value is None else rounded(value)

    return HeadCollapseRow(
        layer=stats.layer,
        head=stats.head,
        kv_head=kv_head,
        verdict=stats.verdict,
        concentration=stats.concentration,
        mean_entropy=rounded(stats.mean_entropy),
        mean_normalised_entropy=rounded(stats.mean_normalised_entropy),
        mean_max_weight=rounded(stats.mean_max_weight),
        saturated_fraction=rounded(stats.saturated_fraction),
        dominant_position=stats.dominant_position,
        dominant_token=tokens[stats.dominant_position].text,
        dominant_share=rounded(stats.dominant_share),
        dominant_argmax_fraction=rounded(stats.dominant_argmax_fraction),
        sink_fraction=rounded(stats.sink_fraction),
        self_fraction=rounded(stats.self_fraction),
        previous_fraction=rounded(stats.previous_fraction),
        top_other_position=stats.top_other_position,
        top_other_token=tokens[stats.top_other_position].text if stats.top_other_position is not None else None,
        top_other_fraction=rounded(stats.top_other_fraction),
        dominant_value_norm=opt(stats.dominant_value_norm),
        other_value_norm=opt(stats.other_value_norm),
        value_norm_ratio=opt(stats.value_norm_ratio),
        dominant_value_share=opt(stats.dominant_value_share),
        dominant_contribution=opt(stats.dominant_contribution),
        contribution_ratio=opt(stats.contribution_ratio),
        mean_output_norm=opt(stats.mean_output_norm),
        mean_centred_score_norm=rounded(stats.mean_centred_score_norm),
        mean_entropy_bound=rounded(stats.mean_entropy_bound),
        min_bound_slack=rounded(stats.min_bound_slack, 6),
        rows=stats.rows,
    )


def _value_side(row: HeadCollapseRow) -> str:
    if row.contribution_ratio is None or row.dominant_contribution is None or row.other_value_norm is None:
        return ""
    return (
        f"; ‖α·v W_O‖ of that key is {row.dominant_contribution:.3g} vs {row.other_value_norm:.3g} for an ordinary "
        f"key's ‖v W_O‖ (ratio {row.contribution_ratio:.2f})"
    )


def _describe(row: HeadCollapseRow) -> str:
    where = f"L{row.layer}H{row.head}"
    onto = f"token {row.dominant_position} {row.dominant_token!r}"
    weight = f"mean max weight {row.mean_max_weight:.3f}, {row.saturated_fraction:.0%} of rows ≥ threshold"
    if row.verdict == "no_op_sink":
        return (
            f"{where} sinks {row.dominant_share:.0%} of its weight onto {onto} ({weight}) but is a no-op: "
            f"it writes almost nothing{_value_side(row)}"
        )
    if row.verdict == "harmful_collapse":
        return (
            f"{where} collapses onto {onto} whatever the query ({weight}) and that key's value is substantial"
            f"{_value_side(row)}: the head writes about the same vector at every position"
        )
    if row.verdict == "positional":
        which = "itself" if row.concentration == "self" else "the previous token"
        frac = row.self_fraction if row.concentration == "self" else row.previous_fraction
        return f"{where} attends to {which} on {frac:.0%} of rows ({weight}): a positional head, not a failure"
    if row.verdict == "query_dependent":
        return f"{where} is sharp ({weight}) but its chosen key changes with the query"
    return (
        f"{where} is not collapsed: mean entropy {row.mean_entropy:.3f} nats ({row.mean_normalised_entropy:.0%} of "
        f"uniform), mean max weight {row.mean_max_weight:.3f}"
    )


def diagnose_collapse(inspector: Inspector, args: DiagnoseCollapseInput) -> CollapseReport:
    """Find collapsed heads (low entropy, max weight near 1), what they collapse onto, and whether it matters.

    One forward pass over the requested layers; per-head statistics are accumulated per layer and query
    chunk and the maps are dropped.
    """
    return inspector.execute(plan_diagnose_collapse(inspector, args))


def plan_diagnose_collapse(inspector: Inspector, args: DiagnoseCollapseInput) -> PassPlan[CollapseReport]:
    """The pass (a :class:`CollapseConsumer` over the requested layers) and the report built from it."""
    loaded = inspector.model(args.model)
    facts = loaded.facts
    layers = check_indices(args.layers, facts.num_layers, "layers")
    heads = check_indices(args.heads, facts.num_heads, "heads")
    encoded = inspector.encode(loaded, args.text)
    if facts.is_causal and encoded.length < 2:
        msg = f"text is {encoded.length} token; collapse needs at least 2 tokens so a query can choose between keys"
        raise InvalidInputError(msg, field="text")
    tokens = encoded.tokens
    sink_mask = torch.tensor([t.special or t.position == 0 for t in tokens])
    grams = output_grams_for(loaded.model, layers, facts.num_heads)
    consumer = CollapseConsumer(sink_mask, heads=heads, threshold=args.threshold, output_grams=grams)

    def finish(_output: object) -> CollapseReport:
        return _report(inspector, args, loaded, encoded, layers, sink_mask, consumer)

    return PassPlan(loaded, encoded, [consumer], finish, layers=layers)


def _report(
    inspector: Inspector,
    args: DiagnoseCollapseInput,
    loaded: LoadedModel,
    encoded: Encoded,
    layers: list[int],
    sink_mask: torch.Tensor,
    consumer: CollapseConsumer,
) -> CollapseReport:
    facts = loaded.facts
    tokens = encoded.tokens
    stats = consumer.results()
    ranked = rank_heads(stats)
    rows = [_row(s, tokens, facts.kv_head_of(s.head)) for s in ranked]
    counts: dict[str, int] = {v: sum(1 for r in rows if r.verdict == v) for v in sorted({r.verdict for r in rows})}
    concentrated = [r for r in rows if r.verdict != "not_collapsed"]
    violations = sum(s.bound_violations for s in stats)

    findings = [
        Finding(
            kind=row.verdict,
            layer=row.layer,
            head=row.head,
            position=row.dominant_position,
            token=row.dominant_token,
            value=row.mean_max_weight,
            detail=_describe(row),
        )
        for row in concentrated[: args.top_k]
    ]
    if rows:
        sharpest = rows[0]
        flattest = min(rows, key=lambda r: r.mean_centred_score_norm)
        findings.append(
            Finding(
                kind="entropy_bound",
                layer=sharpest.layer,
                head=sharpest.head,
                value=sharpest.mean_centred_score_norm,
                detail=(
                    f"Collapse needs large score spread: L{sharpest.layer}H{sharpest.head}'s rows have centred score "
                    f"norm r = {sharpest.mean_centred_score_norm:.2f} (Zhai bound ≥ {sharpest.mean_entropy_bound:.3f} "
                    f"nats), while L{flattest.layer}H{flattest.head} with r = {flattest.mean_centred_score_norm:.2f} "
                    f"must keep ≥ {flattest.mean_entropy_bound:.3f} nats (it has {flattest.mean_entropy:.3f}); "
                    f"{violations} of {sum(s.rows for s in stats)} rows violate the bound"
                ),
            )
        )

    png_path = None
    if args.png:
        grid = [[math.nan] * facts.num_heads for _ in range(facts.num_layers)]
        for s in stats:
            grid[s.layer][s.head] = s.mean_max_weight
        grid = [grid[layer] for layer in layers]
        path = inspector.artifact_path(f"collapse-{loaded.name}-{text_digest(args.text)}", ".png")
        png_path = str(
            grid_heatmap(
                grid,
                f"{loaded.name} — mean max attention weight (1 = collapsed)",
                path,
                colorbar_label="mean max weight",
                cmap="magma",
                vmin=0.0,
                vmax=1.0,
            )
        )

    summary = _summary(encoded.length, rows, concentrated, counts)
    return CollapseReport(
        model=loaded.name,
        summary=summary,
        findings=findings,
        num_tokens=encoded.length,
        threshold=args.threshold,
        heads_examined=len(rows),
        concentrated_heads=len(concentrated),
        verdict_counts=counts,
        sink_positions=[int(i) for i in sink_mask.nonzero().flatten().tolist()],
        bound_violations=violations,
        heads=rows[: args.top_k],
        png_path=png_path,
    )


def _target(row: HeadCollapseRow) -> str:
    if row.verdict == "positional":
        return "itself" if row.concentration == "self" else "the previous token"
    if row.verdict == "query_dependent":
        return "a different key per query"
    return f"{row.dominant_position}:{row.dominant_token!r}"


def _summary(
    length: int, rows: list[HeadCollapseRow], concentrated: list[HeadCollapseRow], counts: dict[str, int]
) -> str:
    head = f"{len(concentrated)} of {len(rows)} heads on {length} tokens are concentrated"
    parked = [
        r
        for r in rows
        if r.verdict == "not_collapsed"
        and r.concentration == "sink"
        and r.dominant_share >= 0.5
        and r.contribution_ratio is not None
        and r.contribution_ratio < NO_OP_CONTRIBUTION
    ]
    tail = (
        f" {len(parked)} more heads park ≥ 50% of their weight on a first/special token that writes little (no-ops)."
        if parked
        else ""
    )
    if not concentrated:
        best = rows[0]
        return (
            f"{head}: none collapses. The sharpest is L{best.layer}H{best.head} (mean max weight "
            f"{best.mean_max_weight:.3f}, onto {_target(best)}).{tail}"
        )
    named = "; ".join(
        f"L{r.layer}H{r.head} → {_target(r)} (mean max {r.mean_max_weight:.3f}, {r.verdict.replace('_', ' ')}"
        + ("" if r.contribution_ratio is None else f", contribution ratio {r.contribution_ratio:.2f}")
        + ")"
        for r in concentrated[:3]
    )
    sinks, harmful = counts.get("no_op_sink", 0), counts.get("harmful_collapse", 0)
    positional = counts.get("positional", 0)
    verdicts = (
        f"{sinks} are no-op sinks (the dominant key writes < {NO_OP_CONTRIBUTION} × an ordinary key's ‖v W_O‖), "
        f"{harmful} collapse harmfully onto one token whatever the query, {positional} are positional."
    )
    return f"{head}. Most collapsed: {named}. {verdicts}{tail}"


SPEC = ToolSpec(
    name="diagnose_collapse",
    description=(
        "Find attention heads that collapse (low entropy, max weight near 1) on a text, in one forward pass over "
        "all layers and heads: per head the entropy (nats and normalised by log of visible keys), mean max weight, "
        "fraction of saturated rows, the dominant key and its share, whether it is a sink (first/special token), "
        "self, previous token or one content token regardless of the query, and - from the value-side norms "
        "‖α·v W_O‖ - whether the collapse is a harmless no-op sink or harmful. Also reports the Zhai et al. "
        "entropy lower bound from the score spread. Ranked, most collapsed first."
    ),
    input_model=DiagnoseCollapseInput,
    output_model=CollapseReport,
    run=diagnose_collapse,
    plan=plan_diagnose_collapse,
    example={"text": "The cat sat on the mat because it was tired.", "top_k": 5},
)
