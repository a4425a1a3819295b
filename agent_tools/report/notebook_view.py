"""How reports render themselves in Jupyter: importing this module registers the functions here with
``schemas.register_notebook_renderer`` (``Report._repr_html_`` / ``_repr_markdown_``) and ``job.ANALYSIS_VIEWS``
(the ``analyze`` result's ``_repr_html_``, ``_repr_markdown_``, ``step`` and ``page``), so neither lower module
imports this one.

A tool's report shows its summary, its key figure and its findings, and the glossary lines of the terms it
uses. The key figure is drawn from the report's own numbers (a report holds no tensors) with the same drawing
functions the ``analyze`` report uses; text front-ends get the figure's numbers as a small table instead. The
``analyze`` result shows the story with the pictures it drew once (:mod:`.figures`); :func:`interactive_page`
wraps the full HTML page (model view, attention view, neuron view) in an iframe.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent_tools.render import (
    Bar,
    CurvePanel,
    GridStyle,
    HeatPanel,
    Series,
    bars_png,
    curves_png,
    grid_png,
    heatmaps_png,
    png_uri,
)
from agent_tools.report.figures import contribution_bars
from agent_tools.report.glossary import Term, terms_in
from agent_tools.report.job import ANALYSIS_VIEWS
from agent_tools.schemas import Report, register_notebook_renderer

if TYPE_CHECKING:
    from agent_tools.report.job import AnalysisResult
    from agent_tools.report.story import StoryStep

FINDINGS_SHOWN = 8
STYLE = (
    "<style>.ae-report{font:14px/1.45 system-ui,sans-serif;max-width:1100px}.ae-report img{max-width:100%;"
    "height:auto;border:1px solid #d9dee7}.ae-report figure{margin:6px 0;display:inline-block;max-width:100%;"
    "vertical-align:top}.ae-report figcaption{color:#5b6475;font-size:12px}.ae-report table{border-collapse:"
    "collapse}.ae-report td,.ae-report th{padding:2px 8px;border-bottom:1px solid #d9dee7;text-align:left;"
    "vertical-align:top}.ae-report .q{color:#5b6475;font-style:italic}.ae-report dt{font-weight:600}</style>"
)


@dataclass(frozen=True)
class KeyFigure:
    """A report's key figure: the picture, its caption, and the numbers it plots (for text front-ends)."""

    png: bytes
    caption: str
    table: list[tuple[str, str]] = field(default_factory=list)


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _figure(png: bytes, caption: str, attributes: str = "") -> str:
    """A picture inlined in HTML with its caption."""
    image = f"<img src='{png_uri(png)}' alt='{_e(caption)}'{attributes}>"
    return f"<figure>{image}<figcaption>{_e(caption)}</figcaption></figure>"


# --- key figures, one per report kind -------------------------------------------------------------------------


def _collapse_figure(report: Any) -> KeyFigure | None:
    rows = [r for r in report.heads if r.contribution_ratio is not None][:16]
    if not rows:
        return None
    png = contribution_bars(
        rows,
        lambda r: f"L{r.layer}H{r.head} ({r.verdict})",
        title="most collapsed heads: what the dominant key writes",
        xlabel="contribution ratio",
    )
    table = [(f"L{r.layer}H{r.head} {r.verdict}", f"ratio {r.contribution_ratio:.2f}") for r in rows]
    return KeyFigure(png, "contribution ratio of the most collapsed heads", table)


def _scaling_figure(report: Any) -> KeyFigure | None:
    settings = sorted(report.settings, key=lambda s: s.beta)
    beta = [s.beta for s in settings]
    model = next(s.beta for s in settings if s.kind == "model_scale")
    marks = [(model, f"model {model:.3g}")]
    panels = [
        CurvePanel(
            title,
            "β",
            ylabel,
            [Series(label, beta, [getattr(s, measure) for s in settings], marker="o")],
            log_x=True,
            marks=marks,
            legend=False,
        )
        for title, ylabel, label, measure in (
            ("entropy (nats)", "entropy", "entropy", "entropy"),
            ("Jacobian trace", "1 − Σp²", "trace", "jacobian_trace"),
        )
    ]
    table = [
        (f"β = {s.beta:.3g} ({s.kind})", f"entropy {s.entropy:.3f}, trace {s.jacobian_trace:.3f}") for s in settings
    ]
    return KeyFigure(curves_png(panels), "the softmax across scales (the model's marked)", table)


def _experiment_figure(report: Any) -> KeyFigure | None:
    lines = [
        Series(f"d_k={c.head_dim} {'scaled' if c.scaled else 'unscaled'}", c.steps, c.loss, dashed=not c.scaled)
        for c in report.runs
    ]
    panel = CurvePanel("loss", "SGD step", "nats", lines, levels=[(report.chance_loss, "chance")])
    table = [
        (f"d_k={c.head_dim} {'scaled' if c.scaled else 'unscaled'}", f"final loss {c.final_loss:.3f}")
        for c in report.runs
    ]
    return KeyFigure(curves_png([panel], panel_width=5.0), "training loss with and without the scale", table)


def _reconstruction_figure(report: Any) -> KeyFigure | None:
    bars = [
        Bar(f"{s.stage} {s.name} (÷ {s.divisor:.3g})", s.masked_js_to_model, "#3b5bdb", f"entropy {s.mean_entropy:.2f}")
        for s in report.stages
    ]
    png = bars_png(
        bars,
        title=f"L{report.layer}H{report.head}: how far each stage is from the model's map",
        xlabel="JS divergence to the model's map, mask held fixed (nats)",
    )
    table = [(f"stage {s.stage} {s.name}", f"JS {s.masked_js_to_model:.3f} nats") for s in report.stages]
    return KeyFigure(png, "each stage's distance to the model's map", table)


def _profile_figure(report: Any) -> KeyFigure | None:
    if not report.heads:
        return None
    layers = max(h.layer for h in report.heads) + 1
    values = [[0.0] * report.num_heads for _ in range(layers)]
    names = [[""] * report.num_heads for _ in range(layers)]
    for h in report.heads:
        if h.primary_role is not None:
            values[h.layer][h.head] = float(h.scores.get(h.primary_role, 0.0))
            names[h.layer][h.head] = h.primary_role[:4]
    png = grid_png(values, "primary role per head", GridStyle("role score", "cividis", 0.0, 1.0, names))
    table = [(r.role, f"top L{r.top[0].layer}H{r.top[0].head} {r.top[0].score:.2f}") for r in report.roles if r.top]
    return KeyFigure(png, "primary role per head (colour = its score)", table)


def _projection_figure(report: Any) -> KeyFigure | None:
    lines = [
        Series(m.name, list(range(1, len(m.singular_values) + 1)), m.singular_values)
        for m in report.matrices
        if m.name in ("W_Q", "W_K", "W_V")
    ]
    panel = CurvePanel("singular values", "index", "σ", lines, log_y=True)
    table = [(m.name, f"effective rank {m.effective_rank:.1f}") for m in report.matrices]
    return KeyFigure(curves_png([panel], panel_width=5.0), "singular values of W_Q, W_K, W_V", table)


def _attention_figure(report: Any) -> KeyFigure | None:
    labels = [f"{t.position}:{t.text}" for t in report.tokens]
    if report.weights is not None:
        weights, caption = report.weights, "the head's map"
    else:  # the top keys of every query: a sparse map
        weights = [[0.0] * len(labels) for _ in labels]
        for row in report.rows:
            for key in row.top_keys:
                weights[row.position][key.position] = key.weight
        caption = "each query's top keys (the rest left blank)"
    png = heatmaps_png([HeatPanel(weights, labels, f"L{report.layer}H{report.head}")], panel_size=4.5)
    table = [
        (f"{r.position}:{r.token}", ", ".join(f"{k.token!r} {k.weight:.2f}" for k in r.top_keys)) for r in report.rows
    ]
    return KeyFigure(png, caption, table[:20])


def _findings_figure(report: Report) -> KeyFigure | None:
    """Any other report: its findings' values as bars (when at least two findings carry one)."""
    valued = [f for f in report.findings if f.value is not None][:12]
    if len(valued) < 2:
        return None
    bars = [
        Bar(
            f.kind + (f" L{f.layer}H{f.head}" if f.layer is not None and f.head is not None else ""),
            float(f.value or 0.0),
            "#3b5bdb",
        )
        for f in valued
    ]
    png = bars_png(bars, title="the findings' values", xlabel="value (see each finding)")
    return KeyFigure(png, "the findings' values", [(b.label, f"{b.value:.4g}") for b in bars])


FIGURES: dict[str, Callable[[Any], KeyFigure | None]] = {
    "CollapseReport": _collapse_figure,
    "ScalingReport": _scaling_figure,
    "ScalingExperimentReport": _experiment_figure,
    "AttentionReconstruction": _reconstruction_figure,
    "HeadProfiles": _profile_figure,
    "ProjectionReport": _projection_figure,
    "AttentionView": _attention_figure,
}
NO_FIGURE = {"ModelDescription"}


def key_figure(report: Report) -> KeyFigure | None:
    """The report's key figure, by its class (None when it has none, e.g. a model card)."""
    name = type(report).__name__
    if name in NO_FIGURE:
        return None
    draw = FIGURES.get(name)
    return draw(report) if draw is not None else _findings_figure(report)


# --- one report -----------------------------------------------------------------------------------------------


def _terms(report: Report) -> list[Term]:
    return terms_in(" ".join([report.summary, *(f.detail for f in report.findings[:FINDINGS_SHOWN])]))


def report_html(report: Report) -> str:
    """Summary, key figure, findings and the terms they use, as an HTML fragment."""
    parts = [
        STYLE,
        f"<div class='ae-report'><p><b>{_e(type(report).__name__)}</b> on {_e(report.model)}</p>",
        f"<p>{_e(report.summary)}</p>",
    ]
    figure = key_figure(report)
    if figure is not None:
        parts.append(_figure(figure.png, figure.caption))
    if report.findings:
        rows = "".join(
            f"<tr><td>{_e(f.kind)}</td><td>{'' if f.layer is None else f.layer}</td>"
            f"<td>{'' if f.head is None else f.head}</td><td>{_e(f.detail)}</td></tr>"
            for f in report.findings[:FINDINGS_SHOWN]
        )
        parts.append(f"<table><tr><th>kind</th><th>layer</th><th>head</th><th>finding</th></tr>{rows}</table>")
    parts.append(_glossary_html(_terms(report)))
    return "".join(parts) + "</div>"


def report_markdown(report: Report) -> str:
    """Summary, the key figure's numbers as a table, findings and terms, as Markdown."""
    lines = [f"**{type(report).__name__}** on `{report.model}`", "", report.summary, ""]
    figure = key_figure(report)
    if figure is not None and figure.table:
        lines += [f"*Key figure: {figure.caption}*", "", "| | |", "|---|---|"]
        lines += [f"| {a} | {b} |" for a, b in figure.table[:20]] + [""]
    lines += [f"- {f.detail}" for f in report.findings[:FINDINGS_SHOWN]]
    terms = _terms(report)
    if terms:
        lines += ["", "Terms: " + "; ".join(f"**{t.name}** = {t.formula}" for t in terms)]
    return "\n".join(lines)


register_notebook_renderer("html", report_html)
register_notebook_renderer("markdown", report_markdown)


def _glossary_html(terms: list[Term]) -> str:
    if not terms:
        return ""
    items = "".join(f"<dt>{_e(t.name)}</dt><dd><code>{_e(t.formula)}</code> — {_e(t.meaning)}</dd>" for t in terms)
    return f"<details><summary>Terms used</summary><dl>{items}</dl></details>"


# --- the analyze result -----------------------------------------------------------------------------------------


def analysis_html(result: AnalysisResult) -> str:
    """The story with its pictures (drawn once), the findings per analysis, the glossary: an HTML fragment."""
    from agent_tools.report.content import sections
    from agent_tools.report.story import build_story, read_first

    steps = build_story(result)
    description = result.reports.get("describe_model")
    parts = [STYLE, f"<div class='ae-report'><h2>Attention of {_e(result.model)}</h2>"]
    if description is not None:
        parts.append(f"<p>{_e(description.summary)}</p>")
    parts.append(f"<p class='q'>{_e(read_first(result, where='notebook'))}</p>")
    parts += [view.body_html() for view in _step_views(result, steps).values()]
    parts.append("<h3>What the analyses found</h3>")
    parts += [
        f"<h4>{_e(title)}</h4><p class='q'>{_e(question)}</p><p>{_e(report.summary)}</p>"
        for title, question, report in sections(result)
    ]
    parts.append(_glossary_html(terms_in(" ".join(" ".join(s.sentences) for s in steps))))
    return "".join(parts) + "</div>"


def analysis_markdown(result: AnalysisResult) -> str:
    """The story's sentences, each analysis's summary and the glossary, as Markdown (no pictures)."""
    from agent_tools.report.content import sections
    from agent_tools.report.story import build_story

    lines = [f"## Attention of `{result.model}`", ""]
    steps = build_story(result)
    for step in steps:
        lines += [f"### {step.number}. {step.title}", f"*{step.question}*", "", " ".join(step.sentences), ""]
    for title, _question, report in sections(result):
        lines += [f"**{title}**: {report.summary}", ""]
    used = " ".join(" ".join(s.sentences) for s in steps)
    lines += ["**Glossary**", ""] + [f"- **{t.name}**: {t.formula} — {t.meaning}" for t in terms_in(used)]
    return "\n".join(lines)


@dataclass(frozen=True)
class StepView:
    """One step of the story for a notebook cell: title, question, sentences and its pictures."""

    title: str
    question: str
    sentences: list[str]
    pictures: list[tuple[str, bytes]]  # (caption, PNG)

    def body_html(self) -> str:
        """The step's title, question, sentences and pictures (no style: the caller's page has it)."""
        figures = "".join(_figure(png, caption, " style='max-width:560px'") for caption, png in self.pictures)
        return (
            f"<h3>{_e(self.title)}</h3><p class='q'>{_e(self.question)}</p><p>{_e(' '.join(self.sentences))}</p>"
            f"{figures}"
        )

    def _repr_html_(self) -> str:
        return f"{STYLE}<div class='ae-report'>{self.body_html()}</div>"

    def _repr_markdown_(self) -> str:
        captions = "".join(f"\n- picture: {caption}" for caption, _ in self.pictures)
        return f"### {self.title}\n*{self.question}*\n\n{' '.join(self.sentences)}\n{captions}"


def _step_views(result: AnalysisResult, steps: list[StoryStep]) -> dict[str, StepView]:
    """Every step of the story with the pictures drawn for it (drawn once, :mod:`.figures`), by key."""
    from agent_tools.report.figures import draw_pictures

    pictures = draw_pictures(result)
    return {
        step.key: StepView(
            f"{step.number}. {step.title}",
            step.question,
            step.sentences,
            [(p.caption, pictures[p.name].png) for p in step.pictures if p.name in pictures],
        )
        for step in steps
    }


def step_view(result: AnalysisResult, key: str) -> StepView:
    """The story's step ``key`` (raw, scale, stages, no_projections, collapse, roles, training)."""
    from agent_tools.report.story import build_story

    views = _step_views(result, build_story(result))
    if key not in views:
        msg = f"no story step {key!r} in this result; steps: {', '.join(views)}"
        raise KeyError(msg)
    return views[key]


@dataclass(frozen=True)
class InteractivePage:
    """The full report page (model view, attention view, neuron view) in an iframe, for a notebook cell."""

    page: str
    height: int = 900

    def _repr_html_(self) -> str:
        return (
            f'<iframe srcdoc="{html.escape(self.page, quote=True)}" style="width:100%;height:{self.height}px;'
            'border:1px solid #d9dee7" sandbox="allow-scripts allow-modals"></iframe>'
        )


def interactive_page(result: AnalysisResult, *, height: int = 900) -> InteractivePage:
    """The page ``write_outputs`` writes as report.html, for display in a notebook."""
    from agent_tools.report.html import page_for, render_html

    return InteractivePage(render_html(page_for(result)), height)


ANALYSIS_VIEWS.update(html=analysis_html, markdown=analysis_markdown, step=step_view, page=interactive_page)
