"""Pictures of attention: PNG heatmaps with token labels, a colour bar and a title (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _label(token: str, limit: int = 14) -> str:
    shown = token.replace("\n", "⏎").replace("\t", "⇥")
    shown = shown if shown.strip() else repr(shown)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def _finish(fig, ax, image, colorbar_label: str, path: str | Path) -> Path:
    """Colour bar, layout, and the PNG written (its folder created)."""
    fig.colorbar(image, ax=ax, label=colorbar_label, fraction=0.046, pad=0.04)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def attention_heatmap(
    weights: Sequence[Sequence[float]],
    query_tokens: Sequence[str],
    key_tokens: Sequence[str],
    title: str,
    path: str | Path,
    *,
    colorbar_label: str = "attention weight",
) -> Path:
    """Write a (queries × keys) heatmap; rows are query tokens, columns the keys they read."""
    rows, cols = len(query_tokens), len(key_tokens)
    size = max(4.0, min(22.0, 0.28 * max(rows, cols) + 2.5))
    fig, ax = plt.subplots(figsize=(size + 1.2, size))
    try:
        image = ax.imshow(weights, cmap="viridis", vmin=0.0, aspect="auto", interpolation="nearest")
        step = max(1, max(rows, cols) // 80)
        ax.set_xticks(range(0, cols, step))
        ax.set_xticklabels([_label(key_tokens[i]) for i in range(0, cols, step)], rotation=90, fontsize=7)
        ax.set_yticks(range(0, rows, step))
        ax.set_yticklabels([_label(query_tokens[i]) for i in range(0, rows, step)], fontsize=7)
        ax.set_xlabel("key (token attended to)")
        ax.set_ylabel("query (token attending)")
        ax.set_title(title, fontsize=10)
        return _finish(fig, ax, image, colorbar_label, path)
    finally:
        plt.close(fig)


def grid_heatmap(
    values: Sequence[Sequence[float]],
    title: str,
    path: str | Path,
    *,
    colorbar_label: str,
    cmap: str = "magma",
    vmin: float | None = None,
    vmax: float | None = None,
    annotations: Sequence[Sequence[str]] | None = None,
) -> Path:
    """A layer × head grid of one number per head (entropy, sink share, role score)."""
    layers = len(values)
    heads = len(values[0]) if layers else 0
    fig, ax = plt.subplots(figsize=(max(4.0, 0.55 * heads + 2.5), max(3.0, 0.28 * layers + 1.5)))
    try:
        image = ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(heads))
        ax.set_xticklabels([str(h) for h in range(heads)], fontsize=7)
        ax.set_yticks(range(layers))
        ax.set_yticklabels([str(layer) for layer in range(layers)], fontsize=7)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=10)
        if annotations is not None:
            for layer in range(layers):
                for head in range(heads):
                    ax.text(head, layer, annotations[layer][head], ha="center", va="center", fontsize=5, color="white")
        return _finish(fig, ax, image, colorbar_label, path)
    finally:
        plt.close(fig)
