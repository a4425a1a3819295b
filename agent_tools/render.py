"""Pictures of attention (matplotlib, Agg): heatmaps with token labels, layer × head grids, curves and bars.

Two kinds of entry point: ``attention_heatmap`` and ``grid_heatmap`` write a PNG file (the tools' ``png``
option); ``attention_png``, ``grid_png``, ``heatmaps_png``, ``curves_png`` and ``bars_png``
return the PNG's bytes, which the ``analyze`` report draws once and shares between its files, its HTML page and
the notebook.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.colors import Normalize, PowerNorm
from matplotlib.patches import Patch

from agent_tools.files import atomic_path

DPI = 110
PALETTE = ("#3b5bdb", "#e8590c", "#2b8a3e", "#c2255c", "#5f3dc4", "#868e96")


def _label(token: str, limit: int = 14) -> str:
    shown = token.replace("\n", "⏎").replace("\t", "⇥")
    shown = shown if shown.strip() else repr(shown)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def _write_png(fig: Any, path: str | Path) -> Path:
    """The figure (colour bar already added) laid out and written as a PNG (its folder created); then closed."""
    try:
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as partial:  # whole or absent: a kill mid-write leaves no truncated PNG under ``out``
            fig.savefig(partial, dpi=DPI, format="png")
        return out
    finally:
        plt.close(fig)


def png_bytes(fig: Any) -> bytes:
    """The figure as PNG bytes (tight bounding box); the figure is closed."""
    try:
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
        return buffer.getvalue()
    finally:
        plt.close(fig)


def png_uri(png: bytes) -> str:
    """PNG bytes as a ``data:`` URI, for a picture inlined in HTML."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _token_axes(ax: Any, query_tokens: Sequence[str], key_tokens: Sequence[str], *, fontsize: float = 7) -> None:
    """Tick labels naming the tokens (every ``step``-th when there are many)."""
    rows, cols = len(query_tokens), len(key_tokens)
    step = max(1, max(rows, cols) // 80)
    ax.set_xticks(range(0, cols, step))
    ax.set_xticklabels([_label(key_tokens[i]) for i in range(0, cols, step)], rotation=90, fontsize=fontsize)
    ax.set_yticks(range(0, rows, step))
    ax.set_yticklabels([_label(query_tokens[i]) for i in range(0, rows, step)], fontsize=fontsize)


def _attention_figure(
    weights: Sequence[Sequence[float]],
    query_tokens: Sequence[str],
    key_tokens: Sequence[str],
    title: str,
) -> Any:
    """A (queries × keys) heatmap with its colour bar, sized to the number of tokens."""
    rows, cols = len(query_tokens), len(key_tokens)
    size = max(4.0, min(22.0, 0.28 * max(rows, cols) + 2.5))
    fig, ax = plt.subplots(figsize=(size + 1.2, size))
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, aspect="auto", interpolation="nearest")
    _token_axes(ax, query_tokens, key_tokens)
    ax.set_xlabel("key (token attended to)")
    ax.set_ylabel("query (token attending)")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="attention weight", fraction=0.046, pad=0.04)
    return fig


def attention_heatmap(
    weights: Sequence[Sequence[float]],
    query_tokens: Sequence[str],
    key_tokens: Sequence[str],
    title: str,
    path: str | Path,
) -> Path:
    """Write a (queries × keys) heatmap; rows are query tokens, columns the keys they read."""
    return _write_png(_attention_figure(weights, query_tokens, key_tokens, title), path)


def attention_png(
    weights: Sequence[Sequence[float]], query_tokens: Sequence[str], key_tokens: Sequence[str], title: str
) -> bytes:
    """The same heatmap as :func:`attention_heatmap`, as PNG bytes."""
    return png_bytes(_attention_figure(weights, query_tokens, key_tokens, title))


@dataclass(frozen=True)
class HeatPanel:
    """One map of a picture: (queries × keys) weights with their token labels and a title."""

    weights: Sequence[Sequence[float]]
    labels: Sequence[str]  # rows and columns (a square map)
    title: str


def _norm(gamma: float) -> Normalize:
    """Linear 0..1, or a power scale (gamma < 1 makes small weights visible; the colour bar says so)."""
    return Normalize(0.0, 1.0) if gamma == 1.0 else PowerNorm(gamma, 0.0, 1.0)


def heatmaps_png(panels: Sequence[HeatPanel], *, gamma: float = 1.0, panel_size: float = 3.6) -> bytes:
    """One or more square attention maps side by side with a shared 0..1 colour bar; PNG bytes."""
    count = len(panels)
    longest = max(len(p.labels) for p in panels)
    size = max(panel_size, min(9.0, 0.13 * longest + 1.6))
    fig, axes = plt.subplots(1, count, figsize=(size * count + 0.9, size + 0.5), squeeze=False)
    image: Any = None
    for ax, panel in zip(axes[0], panels, strict=True):
        image = ax.imshow(panel.weights, cmap="viridis", norm=_norm(gamma), aspect="equal", interpolation="nearest")
        fontsize = 7 if len(panel.labels) <= 24 else 5.5
        _token_axes(ax, panel.labels, panel.labels, fontsize=fontsize)
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
    label = "attention weight" if gamma == 1.0 else f"attention weight (colour ∝ weight^{gamma:g})"
    fig.colorbar(image, ax=list(axes[0]), label=label, fraction=0.046 / count, pad=0.02)
    return png_bytes(fig)


@dataclass(frozen=True)
class GridStyle:
    """How a layer × head grid is coloured and labelled."""

    colorbar_label: str
    cmap: str = "magma"
    vmin: float | None = None
    vmax: float | None = None
    annotations: Sequence[Sequence[str]] | None = None
    annotation_colour: str = "white"  # black on a diverging map, whose middle is white


def _grid_figure(values: Sequence[Sequence[float]], title: str, style: GridStyle) -> Any:
    """A layer × head grid with its colour bar."""
    layers = len(values)
    heads = len(values[0]) if layers else 0
    fig, ax = plt.subplots(figsize=(max(4.0, 0.55 * heads + 2.5), max(3.0, 0.28 * layers + 1.5)))
    image = ax.imshow(values, cmap=style.cmap, vmin=style.vmin, vmax=style.vmax, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(heads))
    ax.set_xticklabels([str(h) for h in range(heads)], fontsize=7)
    ax.set_yticks(range(layers))
    ax.set_yticklabels([str(layer) for layer in range(layers)], fontsize=7)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=10)
    if style.annotations is not None:
        for layer in range(layers):
            for head in range(heads):
                ax.text(
                    head,
                    layer,
                    style.annotations[layer][head],
                    ha="center",
                    va="center",
                    fontsize=5,
                    color=style.annotation_colour,
                )
    fig.colorbar(image, ax=ax, label=style.colorbar_label, fraction=0.046, pad=0.04)
    return fig


def grid_heatmap(values: Sequence[Sequence[float]], title: str, path: str | Path, style: GridStyle) -> Path:
    """A layer × head grid of one number per head (entropy, sink share, role score), written to ``path``."""
    return _write_png(_grid_figure(values, title, style), path)


def grid_png(values: Sequence[Sequence[float]], title: str, style: GridStyle) -> bytes:
    """The same grid as :func:`grid_heatmap`, as PNG bytes."""
    return png_bytes(_grid_figure(values, title, style))


@dataclass(frozen=True)
class Series:
    """One line of a curve panel."""

    label: str
    x: Sequence[float]
    y: Sequence[float]
    colour: str | None = None
    dashed: bool = False
    marker: str | None = None
    line: bool = True  # False: markers only (measured points)


@dataclass(frozen=True)
class CurvePanel:
    """One panel of curves: axes, lines, and marked positions (vertical lines) and levels (horizontal)."""

    title: str
    xlabel: str
    ylabel: str
    series: Sequence[Series]
    log_x: bool = False
    log_y: bool = False
    marks: Sequence[tuple[float, str]] = field(default_factory=tuple)  # (x, label): vertical lines
    levels: Sequence[tuple[float, str]] = field(default_factory=tuple)  # (y, label): horizontal lines
    legend: bool = True
    legend_at: str = "best"


def _draw_panel(ax: Any, panel: CurvePanel) -> None:
    for i, line in enumerate(panel.series):
        colour = line.colour or PALETTE[i % len(PALETTE)]
        style = "none" if not line.line else ("--" if line.dashed else "-")
        ax.plot(
            line.x, line.y, linestyle=style, color=colour, marker=line.marker, markersize=5, linewidth=1.6,
            label=line.label,
        )  # fmt: skip
    for x, label in panel.marks:
        ax.axvline(x, color="#495057", linestyle=":", linewidth=1.2)
        ax.annotate(label, (x, 1.0), xycoords=("data", "axes fraction"), fontsize=7, rotation=90, va="top", ha="right")
    for y, label in panel.levels:
        ax.axhline(y, color="#868e96", linestyle="-.", linewidth=1.0)
        ax.annotate(label, (0.01, y), xycoords=("axes fraction", "data"), fontsize=7, va="bottom", color="#495057")
    if panel.log_x:
        ax.set_xscale("log")
    if panel.log_y:
        ax.set_yscale("log")
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel(panel.xlabel, fontsize=8)
    ax.set_ylabel(panel.ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.25)
    if panel.legend and panel.series:
        ax.legend(fontsize=6.5, frameon=False, loc=panel.legend_at)


def curves_png(panels: Sequence[CurvePanel], *, panel_width: float = 3.4) -> bytes:
    """Curve panels side by side; PNG bytes."""
    fig, axes = plt.subplots(1, len(panels), figsize=(panel_width * len(panels), 3.0), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        _draw_panel(ax, panel)
    fig.tight_layout()
    return png_bytes(fig)


@dataclass(frozen=True)
class Bar:
    """One horizontal bar: its label, value, colour and a note written at its end."""

    label: str
    value: float
    colour: str
    note: str = ""


def bars_png(
    bars: Sequence[Bar],
    *,
    title: str,
    xlabel: str,
    threshold: tuple[float, str] | None = None,
    legend: Sequence[tuple[str, str]] = (),
) -> bytes:
    """Horizontal bars, first on top, with an optional threshold line and a colour legend; PNG bytes."""
    fig, ax = plt.subplots(figsize=(6.4, max(2.2, 0.26 * len(bars) + 1.1)))
    positions = list(range(len(bars)))[::-1]
    ax.barh(positions, [b.value for b in bars], color=[b.colour for b in bars], height=0.7)
    ax.set_yticks(positions)
    ax.set_yticklabels([b.label for b in bars], fontsize=7)
    top = max([b.value for b in bars] + [threshold[0] if threshold else 0.0, 1e-9])
    for y, bar in zip(positions, bars, strict=True):
        if bar.note:
            ax.text(bar.value + 0.01 * top, y, bar.note, va="center", fontsize=6.5, color="#343a40")
    if threshold is not None:
        ax.axvline(threshold[0], color="#212529", linestyle="--", linewidth=1.1)
        ax.annotate(
            f" {threshold[1]}", (threshold[0], 0.01), xycoords=("data", "axes fraction"), fontsize=7, va="bottom"
        )
    if legend:
        handles = [Patch(color=colour, label=name) for colour, name in legend]
        ax.legend(handles=handles, fontsize=7, frameon=False, loc="center right")
    ax.set_xlim(0, top * 1.25)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    return png_bytes(fig)
