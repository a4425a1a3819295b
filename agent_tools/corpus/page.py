"""The run's HTML page: one self-contained file (inline CSS and SVG, no script, nothing fetched).

Head tasks: a layer × head grid of role stability (each cell names the head's usual role; darker = the same role
on more items), a grid of collapse frequency, histograms of the scores over every (item, head) row and of the
stability over heads, and the stable and variable heads. Trace: how often the answer read each segment most
(with its bootstrap interval), histograms of the share per segment kind, and the segment table.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

BINS = 20
LISTED = 25  # rows of the stable / variable / error lists shown
STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table.grid{border-collapse:collapse;font-size:10px}
table.grid td,table.grid th{width:34px;height:22px;text-align:center;border:1px solid #fff;padding:0}
table.list{border-collapse:collapse}table.list td,table.list th{padding:2px 8px;border-bottom:1px solid #ddd}
.charts{display:flex;flex-wrap:wrap;gap:16px}svg{background:#fafafa;border:1px solid #eee}
.note{color:#666}
"""


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _shade(value: float | None, hue: int) -> str:
    """A cell colour: white (0) to saturated (1) of ``hue``; grey for no value."""
    if value is None or not math.isfinite(value):
        return "#eee"
    light = 97 - 55 * max(0.0, min(1.0, value))
    return f"hsl({hue},60%,{light:.0f}%)"


def histogram_svg(values: Sequence[float], title: str, *, bins: int = BINS, width: int = 280, height: int = 150) -> str:
    """A histogram of ``values`` (NaN dropped) as an inline SVG, with its range and count."""
    data = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    head = f'<svg width="{width}" height="{height}" role="img"><title>{_esc(title)}</title>'
    label = f'<text x="6" y="14" font-size="11">{_esc(title)} (n={data.size})</text>'
    if data.size == 0:
        return head + label + "</svg>"
    low, high = float(data.min()), float(data.max())
    counts, _ = np.histogram(data, bins=bins, range=(low, high if high > low else low + 1e-9))
    top, plot_h, bar_w = max(int(counts.max()), 1), height - 40, (width - 12) / bins
    bars = [
        f'<rect x="{6 + i * bar_w:.1f}" y="{20 + plot_h - c / top * plot_h:.1f}" width="{bar_w - 1:.1f}" '
        f'height="{c / top * plot_h:.1f}" fill="#4a7ab5"><title>{c}</title></rect>'
        for i, c in enumerate(counts.tolist())
    ]
    axis = (
        f'<text x="6" y="{height - 6}" font-size="10">{low:.3g}</text>'
        f'<text x="{width - 6}" y="{height - 6}" font-size="10" text-anchor="end">{high:.3g}</text>'
    )
    return head + label + "".join(bars) + axis + "</svg>"


def bars_svg(rows: Sequence[tuple[str, float, float | None, float | None]], title: str, *, width: int = 560) -> str:
    """Horizontal bars in [0, 1] with interval whiskers: (label, value, low, high) per bar."""
    height = 26 + 18 * len(rows)
    parts = [f'<svg width="{width}" height="{height}" role="img"><title>{_esc(title)}</title>']
    parts.append(f'<text x="6" y="14" font-size="11">{_esc(title)}</text>')
    left, span = 150, width - 200
    for i, (label, value, low, high) in enumerate(rows):
        y = 22 + 18 * i
        parts.append(f'<text x="{left - 6}" y="{y + 11}" font-size="11" text-anchor="end">{_esc(label)}</text>')
        parts.append(f'<rect x="{left}" y="{y}" width="{span * value:.1f}" height="13" fill="#4a7ab5"/>')
        if low is not None and high is not None:
            parts.append(
                f'<line x1="{left + span * low:.1f}" x2="{left + span * high:.1f}" y1="{y + 6}" y2="{y + 6}" '
                'stroke="#222" stroke-width="1.5"/>'
            )
        parts.append(f'<text x="{left + span * value + 4:.1f}" y="{y + 11}" font-size="10">{value:.2f}</text>')
    return "".join(parts) + "</svg>"


def head_grid(heads: Sequence[dict[str, Any]], value: str, *, hue: int, text: str | None) -> str:
    """A layer × head table: cell colour from ``value`` (a head's key, or ``metric:name`` for a mean)."""
    if not heads:
        return '<p class="note">no heads</p>'
    cells = {(h["layer"], h["head"]): h for h in heads}
    layers = sorted({h["layer"] for h in heads})
    columns = sorted({h["head"] for h in heads})
    out = ['<table class="grid"><tr><th>L \\ H</th>', *(f"<th>{c}</th>" for c in columns), "</tr>"]
    for layer in layers:
        out.append(f"<tr><th>{layer}</th>")
        for column in columns:
            h = cells.get((layer, column))
            if h is None:
                out.append("<td></td>")
                continue
            shown = h["metrics"][value.split(":", 1)[1]]["mean"] if value.startswith("metric:") else h[value]
            roles = ", ".join(f"{r} {s:.2f}" for r, s in h["roles"].items())
            tip = f"{h['label']}: {h['role']} on {_fmt(h['role_share'], 2)} of {h['items']} items ({roles})"
            word = _esc(str(h[text])[:5]) if text else _fmt(shown, 2)
            out.append(f'<td style="background:{_shade(shown, hue)}" title="{_esc(tip)}">{word}</td>')
        out.append("</tr>")
    return "".join(out) + "</table>"


def _list(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> str:
    if not rows:
        return '<p class="note">none</p>'
    head = "".join(f"<th>{_esc(k)}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td>{_esc(_cell(row.get(k)))}</td>" for k in keys) + "</tr>" for row in rows[:LISTED]
    )
    more = f'<p class="note">… and {len(rows) - LISTED} more in summary.json</p>' if len(rows) > LISTED else ""
    return f'<table class="list"><tr>{head}</tr>{body}</table>{more}'


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.3f}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_cell(v)}" for k, v in list(value.items())[:4])
    return "" if value is None else str(value)


def _head_sections(summary: dict[str, Any], table: Any) -> list[str]:
    heads = summary["heads"]
    metrics = [c for c in table.columns if c.startswith("score_")] + [
        c for c in ("mean_normalised_entropy", "mean_max_weight", "sink_fraction") if c in table
    ]
    charts = [histogram_svg([h["role_share"] for h in heads], "role stability (heads)")]
    charts += [histogram_svg(table[m].tolist(), m.removeprefix("score_")) for m in metrics if table[m].notna().any()]
    return [
        "<h2>Role stability (layer × head)</h2>",
        '<p class="note">Each cell: the head\'s most frequent role; darker = that role on more items '
        f"(stable at ≥ {summary['stable_share']:.0%}). Hover for the shares.</p>",
        head_grid(heads, "role_share", hue=140, text="role"),
        "<h2>Collapse frequency (share of items where the head is concentrated)</h2>",
        head_grid(heads, "metric:collapsed", hue=10, text=None),
        "<h2>Distributions</h2>",
        '<p class="note">Role stability over the heads; each score over every (item, head) row (role scores are '
        "named without their score_ prefix).</p>",
        '<div class="charts">' + "".join(charts) + "</div>",
        "<h2>Stable heads</h2>",
        _list(summary["stable_heads"], ("head", "role", "share")),
        "<h2>Variable heads</h2>",
        _list(summary["variable_heads"], ("head", "role", "share", "roles")),
    ]


def _trace_sections(summary: dict[str, Any], table: Any) -> list[str]:
    def rate_rows(rows: list[dict[str, Any]], key: str) -> list[tuple[str, float, float | None, float | None]]:
        shown = [r for r in rows if r["read_most_rate"]["mean"] is not None][:LISTED]
        return [
            (r[key], r["read_most_rate"]["mean"], r["read_most_rate"]["ci_low"], r["read_most_rate"]["ci_high"])
            for r in shown
        ]

    per_kind = table.groupby(["item", "kind"])["share"].sum().reset_index()
    charts = [histogram_svg(g["share"].tolist(), f"share read: {k}") for k, g in per_kind.groupby("kind")]
    segment_rows = [
        {
            "segment": r["segment"],
            "kind": r["kind"],
            "items": r["items"],
            "share": r["metrics"]["share"]["mean"],
            "read most": r["read_most_rate"]["mean"],
        }
        for r in summary["segments"]
    ]
    return [
        "<h2>How often the answer reads each segment most</h2>",
        bars_svg(rate_rows(summary["kinds"], "kind"), "read-most rate by kind (bootstrap 95% interval)"),
        bars_svg(rate_rows(summary["segments"], "segment"), "read-most rate by segment"),
        "<h2>Share of the answer's attention, per kind</h2>",
        '<div class="charts">' + "".join(charts) + "</div>",
        "<h2>Segments</h2>",
        _list(segment_rows, ("segment", "kind", "items", "share", "read most")),
    ]


def render_page(summary: dict[str, Any], table: Any, errors: Any) -> str:
    """The whole page for a run's summary, table and errors (pandas DataFrames)."""
    sections = _trace_sections(summary, table) if summary["task"] == "trace" else _head_sections(summary, table)
    if not summary["segments" if summary["task"] == "trace" else "heads"]:
        sections = ['<p class="note">no item could be analysed</p>']
    error_rows = errors.head(LISTED).to_dict("records") if len(errors) else []
    title = f"corpus {summary['task']} — {summary.get('model', '')}"
    facts = (
        f"{summary['items']} items: {summary['analysed']} analysed, {summary['errors']} errors · data "
        f"{summary.get('data', '')} · bootstrap {summary['bootstrap']['resamples']} resamples, seed "
        f"{summary['bootstrap']['seed']}"
    )
    return "".join(
        [
            '<!doctype html><html lang="en"><head><meta charset="utf-8">',
            f"<title>{_esc(title)}</title><style>{STYLE}</style></head><body>",
            f"<h1>{_esc(title)}</h1><p>{_esc(facts)}</p>",
            *sections,
            "<h2>Errors</h2>",
            _list(error_rows, ("item", "id", "kind", "reason")),
            "</body></html>",
        ]
    )
