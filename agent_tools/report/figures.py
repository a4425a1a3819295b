"""Every picture of an ``analyze`` run, drawn once: the story's figures, the layer × head grids and the maps of
the heads worth a look. The PNG bytes are kept on the result, so the files, the HTML page, the terminal's list
and the notebook all show the same pictures without drawing them again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from agent_tools.analysis.collapse import NO_OP_CONTRIBUTION
from agent_tools.analysis.metrics import SATURATION
from agent_tools.render import (
    Bar,
    CurvePanel,
    GridStyle,
    HeatPanel,
    Series,
    attention_png,
    bars_png,
    curves_png,
    grid_png,
    heatmaps_png,
)
from agent_tools.report.content import role_grid_values, top_heads
from agent_tools.report.job import AnalysisResult
from agent_tools.report.long_context import plan_grid
from agent_tools.report.story import STAGE_SHORT, build_story
from agent_tools.tools.diagnose_collapse.models import CollapseReport, HeadCollapseRow
from agent_tools.tools.explain_scaling.models import ScalingReport
from agent_tools.tools.find_retrieval_heads.models import FindRetrievalHeadsReport
from agent_tools.tools.plan_kv_cache.models import PlanKvCacheReport
from agent_tools.tools.position_sensitivity.models import PositionSensitivityReport
from agent_tools.tools.scaling_experiment.models import ScalingExperimentReport

HARMFUL, SINK, OTHER = "#c92a2a", "#868e96", "#3b5bdb"
STAGE_GAMMA = 0.5  # stage maps range from one-hot to nearly uniform: a square-root colour scale shows both


@dataclass(frozen=True)
class Picture:
    """One drawn picture: its file stem, caption, and PNG bytes."""

    name: str
    caption: str
    png: bytes


# --- the story's pictures -----------------------------------------------------------------------------------


def _stage(result: AnalysisResult, number: int) -> bytes | None:
    views = result.stages
    if views is None or number > len(views.stage_weights):
        return None
    name = views.stage_names[number - 1]
    title = f"{number}. {STAGE_SHORT.get(name, name)} (÷ {views.stage_divisors[number - 1]:.3g})"
    return heatmaps_png([HeatPanel(views.stage_weights[number - 1], views.labels, title)], gamma=STAGE_GAMMA)


def _no_projections(result: AnalysisResult) -> bytes | None:
    views = result.stages
    if views is None:
        return None
    where = f"L{views.layer}H{views.head}"
    panels = [
        HeatPanel(views.counterfactual, views.labels, "Q = K = V = x (no projections)"),
        HeatPanel(views.stage_weights[-1], views.labels, f"the real head {where}"),
    ]
    return heatmaps_png(panels, gamma=STAGE_GAMMA)


def _variance(result: AnalysisResult) -> bytes | None:
    """Var(q·k) against d_k: the random-vector demonstration, this layer's heads raw and scaled."""
    scaling = result.report("explain_scaling", ScalingReport)
    if scaling is None:
        return None
    dims = [row.head_dim for row in scaling.synthetic]
    d_k = scaling.head_dim
    heads = scaling.head_variances
    measured = (  # this layer's heads side by side at d_k: (label, x, variances, colour, marker)
        (f"layer {scaling.layer}'s heads: Var(q·k)", d_k, [h.raw_variance for h in heads], HARMFUL, "x"),
        ("  predicted var(q)·var(k)·d_k", d_k * 0.9, [h.predicted_isotropic for h in heads], "#f08c00", "+"),
        ("  after the model's scale", d_k * 1.1, [h.scaled_variance for h in heads], "#2b8a3e", "o"),
    )
    styled = [
        Series("random q, k: Var(q·k)", dims, [r.dot_variance for r in scaling.synthetic], marker="o"),
        Series("random q, k: ÷ sqrt(d_k)", dims, [r.scaled_variance for r in scaling.synthetic], marker="o"),
        Series("Var = d_k", dims, dims, colour="#adb5bd", dashed=True),
        *(Series(label, [x] * len(ys), ys, colour, marker=m, line=False) for label, x, ys, colour, m in measured),
    ]
    panel = CurvePanel(
        f"Var(q·k) grows with d_k (this model: d_k = {d_k})", "d_k", "variance", styled, log_x=True, log_y=True
    )
    return curves_png([panel], panel_width=5.6)


SWEEP = {  # picture -> (title, y label, the ScaleSetting field it plots)
    "story-2-entropy": ("entropy (nats)", "mean entropy", "entropy"),
    "story-2-saturation": ("saturated rows", f"share of rows with max ≥ {SATURATION}", "saturated_fraction"),
    "story-2-jacobian": ("Jacobian trace 1 − Σp²", "gradient through the softmax", "jacobian_trace"),
}


def _sweep(result: AnalysisResult, name: str) -> bytes | None:
    """One measure across the temperature sweep of β, the model's scale and 'no scale' marked."""
    scaling = result.report("explain_scaling", ScalingReport)
    if scaling is None:
        return None
    title, ylabel, measure = SWEEP[name]
    settings = sorted(scaling.settings, key=lambda s: s.beta)
    beta = [s.beta for s in settings]
    model_beta = next(s.beta for s in settings if s.kind == "model_scale")
    marks = [(model_beta, f"model {model_beta:.3g}"), (1.0, "no scale")]
    line = Series(title, beta, [float(getattr(s, measure)) for s in settings], marker="o")
    panel = CurvePanel(title, "β (factor on q·k)", ylabel, [line], log_x=True, marks=marks, legend=False)
    return curves_png([panel])


def _value_norms(result: AnalysisResult) -> bytes | None:
    """The concentrated heads' contribution ratio (writing collapses first), the no-op threshold marked."""
    collapse = result.report("diagnose_collapse", CollapseReport)
    if collapse is None:
        return None
    rows = [r for r in (result.collapse_rows or collapse.heads) if r.contribution_ratio is not None]
    concentrated = [r for r in rows if r.verdict in ("writing_collapse", "no_op_sink")]
    shown = sorted(concentrated, key=lambda r: (r.verdict != "writing_collapse", -r.mean_max_weight))[:20]
    if not shown:
        shown = rows[:10]
    if not shown:
        return None
    return contribution_bars(
        shown,
        lambda r: f"L{r.layer}H{r.head} → {r.dominant_position}:{r.dominant_token.strip() or repr(r.dominant_token)}",
        title="What the collapsed key writes, relative to an ordinary key",
        xlabel="contribution ratio = ‖α·v W_O‖ of the dominant key / ‖v W_O‖ of an ordinary key",
    )


def contribution_bars(
    rows: Sequence[HeadCollapseRow], label: Callable[[HeadCollapseRow], str], *, title: str, xlabel: str
) -> bytes:
    """Each head's contribution ratio as a bar coloured by its verdict (its mean max weight noted), the no-op
    threshold marked: the analyze story's value-norm picture and diagnose_collapse's key figure."""
    colour = {"writing_collapse": HARMFUL, "no_op_sink": SINK}
    bars = [
        Bar(label(r), float(r.contribution_ratio or 0.0), colour.get(r.verdict, OTHER), f"max {r.mean_max_weight:.2f}")
        for r in rows
    ]
    return bars_png(
        bars,
        title=title,
        xlabel=xlabel,
        threshold=(NO_OP_CONTRIBUTION, f"no-op below {NO_OP_CONTRIBUTION}"),
        legend=[(HARMFUL, "writes substantially (value norms)"), (SINK, "no-op sink")],
    )


def _induction(result: AnalysisResult) -> bytes | None:
    probe = result.probe
    if probe is None:
        return None
    title = f"L{probe.layer}H{probe.head} on [BOS] + {probe.repeat_length} random tokens × 2"
    return heatmaps_png([HeatPanel(probe.weights, probe.labels, title)], panel_size=5.0)


def _run_lines(experiment: ScalingExperimentReport, values: str) -> list[Series]:
    """One line per training run of ``values`` (a curve of ExperimentCurve), scaled runs solid."""
    colours = {(True, 0): "#2b8a3e", (True, 1): "#3b5bdb", (False, 0): "#f08c00", (False, 1): "#c92a2a"}
    dims = sorted({c.head_dim for c in experiment.runs})
    lines = []
    for c in experiment.runs:
        ys = [max(v, 1e-12) for v in getattr(c, values)] if values == "grad_norm_q" else list(getattr(c, values))
        label = f"d_k={c.head_dim} {'÷sqrt(d_k)' if c.scaled else 'unscaled'}"
        lines.append(Series(label, c.steps, ys, colours[(c.scaled, dims.index(c.head_dim) % 2)], dashed=not c.scaled))
    return lines


def _training(result: AnalysisResult, name: str) -> bytes | None:
    """Loss, accuracy or ‖∂L/∂W_q‖ over steps for the four runs (the chance loss marked on the loss)."""
    experiment = result.report("scaling_experiment", ScalingExperimentReport)
    if experiment is None:
        return None
    chance = [(experiment.chance_loss, f"chance ln {experiment.labels} = {experiment.chance_loss:.2f}")]
    panels: dict[str, tuple[str, str, str, dict[str, Any]]] = {
        "story-7-loss": ("loss", "cross-entropy (nats)", "loss", {"levels": chance, "legend": False}),
        "story-7-accuracy": ("accuracy", "share correct", "accuracy", {"legend_at": "center right"}),
        "story-7-gradient": ("‖∂L/∂W_q‖", "gradient norm", "grad_norm_q", {"log_y": True, "legend": False}),
    }
    title, ylabel, values, options = panels[name]
    return curves_png([CurvePanel(title, "SGD step", ylabel, _run_lines(experiment, values), **options)])


def _retrieval(result: AnalysisResult) -> bytes | None:
    """find_retrieval_heads' layer × head grid of mean retrieval scores, on a fixed 0..1 scale."""
    retrieval = result.report("find_retrieval_heads", FindRetrievalHeadsReport)
    if retrieval is None or not retrieval.score_grid:
        return None
    title = f"{result.model} — retrieval score per head ({len(retrieval.haystacks)} haystacks)"
    return grid_png(retrieval.score_grid, title, GridStyle("retrieval score (0..1)", "viridis", 0.0, 1.0))


def _kv_plan(result: AnalysisResult) -> bytes | None:
    """plan_kv_cache's loss change per layer × KV head (columns are KV heads), planned heads marked S; the colour
    scale is symmetric about 0 (red: the short cache hurts)."""
    plan = result.report("plan_kv_cache", PlanKvCacheReport)
    if plan is None or not plan.heads:
        return None
    values, marks = plan_grid(plan)
    bound = max(1e-6, max(abs(v) for row in values for v in row))
    style = GridStyle("loss change (nats)", "RdBu_r", -bound, bound, marks, annotation_colour="black")
    title = f"{result.model} — loss change per KV head (columns: KV heads), sink {plan.sink} + window {plan.window}"
    return grid_png(values, title, style)


def _u_curve(result: AnalysisResult) -> bytes | None:
    """position_sensitivity's answer log-probability and the needle's attention share against the needle's depth
    (five points: one picture of two small panels, whatever the text's length)."""
    report = result.report("position_sensitivity", PositionSensitivityReport)
    if report is None or not report.positions:
        return None
    points = sorted(report.positions, key=lambda p: p.relative_depth)
    depths = [p.relative_depth for p in points]
    best = next(p for p in points if p.slot == report.best_slot)
    worst = next(p for p in points if p.slot == report.worst_slot)
    marks = [(best.relative_depth, "best"), (worst.relative_depth, "worst")]
    logprob = Series("log p(answer)", depths, [p.answer_logprob for p in points], "#3b5bdb", marker="o")
    share = Series("attention share", depths, [p.attention_share for p in points], "#f08c00", marker="o")
    return curves_png(
        [
            CurvePanel("the answer", "needle depth (0 = start)", "log p(answer), nats", [logprob], marks=marks),
            CurvePanel("attention on the needle", "needle depth (0 = start)", "share", [share], legend=False),
        ]
    )


SAME_PICTURE = {"story-1-raw-dot": "story-3-stage-1"}  # drawn once, shown in both steps
STORY_DRAWINGS: dict[str, Callable[[AnalysisResult], bytes | None]] = {
    "story-2-variance": _variance,
    **{name: partial(_sweep, name=name) for name in SWEEP},
    **{f"story-3-stage-{n}": partial(_stage, number=n) for n in range(1, 6)},
    "story-4-no-projections": _no_projections,
    "story-5-value-norms": _value_norms,
    "story-6-induction-probe": _induction,
    **{name: partial(_training, name=name) for name in ("story-7-loss", "story-7-accuracy", "story-7-gradient")},
    "story-8-retrieval": _retrieval,
    "story-8-kv-plan": _kv_plan,
    "story-8-u-curve": _u_curve,
}


# --- grids and heads ----------------------------------------------------------------------------------------


def _grids(result: AnalysisResult) -> list[Picture]:
    maps = result.maps
    specs = [
        ("entropy", maps.normalised_entropy, "mean normalised entropy (0 = one key, 1 = uniform)", "viridis"),
        ("sink-share", maps.first_token_share, "mean attention on the first token", "magma"),
    ]
    pictures = []
    for name, values, label, cmap in specs:
        png = grid_png(values.tolist(), f"{result.model} — {label}", GridStyle(label, cmap, 0.0, 1.0))
        pictures.append(Picture(f"grid-{name}", f"Layer × head: {label}", png))
    role_grid = role_grid_values(result)
    if role_grid is not None:
        scores, names = role_grid
        style = GridStyle("primary role score", "cividis", 0.0, 1.0, names)
        png = grid_png(scores, f"{result.model} — primary role per head (colour = confidence)", style)
        pictures.append(Picture("grid-role", "Layer × head: primary role (abbreviated) and its score", png))
    return pictures


def _head_maps(result: AnalysisResult) -> list[Picture]:
    kept = result.maps.maps
    if kept is None:  # the text was too long to keep every map
        return []
    labels = [f"{t.position}:{t.text}" for t in result.tokens]
    pictures = []
    for why, layer, head in top_heads(result):
        weights = kept[layer, head].float() / 255  # (T, T), weight × 255 back to weights
        title = f"{result.model} — layer {layer}, head {head} ({why})"
        pictures.append(
            Picture(f"head-L{layer}-H{head}", title, attention_png(weights.tolist(), labels, labels, title))
        )
    return pictures


def _story_png(result: AnalysisResult, name: str, drawn: dict[str, Picture]) -> bytes | None:
    """A story picture's PNG, reusing one already drawn under the name it shares."""
    same = SAME_PICTURE.get(name, name)
    if same in drawn:
        return drawn[same].png
    draw = STORY_DRAWINGS.get(same)
    return draw(result) if draw is not None else None


def draw_pictures(result: AnalysisResult) -> dict[str, Picture]:
    """Every picture of the run, drawn on the first call and kept on ``result`` (name -> picture)."""
    if result.pictures:
        return result.pictures
    pictures: dict[str, Picture] = {}
    grids = {p.name: p for p in _grids(result)}
    for step in build_story(result):
        for wanted in step.pictures:
            png = grids[wanted.name].png if wanted.name in grids else _story_png(result, wanted.name, pictures)
            if png is not None:
                pictures[wanted.name] = Picture(wanted.name, wanted.caption, png)
    for picture in [*grids.values(), *_head_maps(result)]:
        pictures.setdefault(picture.name, picture)
    result.pictures.update(pictures)
    return result.pictures
