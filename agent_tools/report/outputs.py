"""Files of an ``analyze`` run: report.json, PNG heatmaps and grids, and the self-contained report.html."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_tools.render import attention_heatmap, grid_heatmap
from agent_tools.report.html import HtmlReport, write_html
from agent_tools.report.job import AnalysisResult

if TYPE_CHECKING:
    import torch

SECTION_TITLES = {
    "describe_model": "Model",
    "diagnose_collapse": "Collapse and sinks",
    "explain_scaling": "What 1/sqrt(d_k) does here",
    "profile_heads": "What each head does",
    "inspect_projections": "Projections W_q, W_k, W_v",
}


ROLE_ABBREVIATIONS = {
    "previous_token": "prev",
    "induction": "ind",
    "duplicate_token": "dup",
    "first_token": "sink",
    "self": "self",
    "local": "loc",
    "broad": "brd",
    "special_token": "spec",
    "punctuation": "punc",
    "next_token": "next",
}


def _labels(result: AnalysisResult) -> list[str]:
    return [f"{t.position}:{t.text}" for t in result.tokens]


def top_heads(result: AnalysisResult, count: int = 3) -> list[tuple[str, int, int]]:
    """(why, layer, head) for the heads worth a picture: most collapsed, strongest sink, broadest."""
    maps = result.maps
    heads = maps.normalised_entropy.shape[1]
    chosen: list[tuple[str, int, int]] = []

    def add(why: str, flat_index: int) -> None:
        layer, head = divmod(int(flat_index), heads)
        if all((layer, head) != (c[1], c[2]) for c in chosen):
            chosen.append((why, layer, head))

    for index in maps.normalised_entropy.flatten().argsort()[:count].tolist():
        add("most concentrated", index)
    for index in maps.first_token_share.flatten().argsort(descending=True)[:count].tolist():
        add("strongest first-token sink", index)
    for index in maps.normalised_entropy.flatten().argsort(descending=True)[:1].tolist():
        add("broadest", index)
    for name, report in result.reports.items():
        if name != "profile_heads":
            continue
        for role in getattr(report, "roles", []):
            qualified = [t for t in role.top if t.qualifies]
            if qualified and role.role in {"previous_token", "induction", "duplicate_token", "self", "local"}:
                add(
                    f"top {role.role.replace('_', '-')} head, score {qualified[0].score:.2f}",
                    qualified[0].layer * heads + qualified[0].head,
                )
    return chosen


def write_pngs(result: AnalysisResult, out: Path) -> list[tuple[str, Path]]:
    """The layer × head grids (entropy, sink share, primary role) and the maps of the heads worth a picture."""
    maps = result.maps
    plots: list[tuple[str, Path]] = []
    grid_specs = [
        ("entropy", maps.normalised_entropy, "mean normalised entropy (0 = one key, 1 = uniform)", "viridis", 0.0, 1.0),
        ("sink-share", maps.first_token_share, "mean attention on the first token", "magma", 0.0, 1.0),
    ]
    for name, values, label, cmap, lo, hi in grid_specs:
        path = grid_heatmap(
            values.tolist(),
            f"{result.model} — {label}",
            out / f"grid-{name}.png",
            colorbar_label=label,
            cmap=cmap,
            vmin=lo,
            vmax=hi,
        )
        plots.append((f"Layer × head: {label}", path))
    role_grid = role_grid_values(result)
    if role_grid is not None:
        scores, names = role_grid
        path = grid_heatmap(
            scores,
            f"{result.model} — primary role per head (colour = confidence)",
            out / "grid-role.png",
            colorbar_label="primary role score",
            cmap="cividis",
            vmin=0.0,
            vmax=1.0,
            annotations=names,
        )
        plots.append(("Layer × head: primary role (abbreviated) and its score", path))
    if maps.maps is not None:  # None when the text was too long to keep every map
        plots += head_pictures(result, maps.maps, out)
    return plots


def head_pictures(result: AnalysisResult, kept: torch.Tensor, out: Path) -> list[tuple[str, Path]]:
    """A heatmap of each head :func:`top_heads` picks, from the kept maps ``kept`` (L, H, T, T) uint8."""
    labels = _labels(result)
    plots = []
    for why, layer, head in top_heads(result):
        weights = kept[layer, head].float() / 255  # (T, T), weight × 255 back to weights
        title = f"{result.model} — layer {layer}, head {head} ({why})"
        path = attention_heatmap(weights.tolist(), labels, labels, title, out / f"head-L{layer}-H{head}.png")
        plots.append((title, path))
    return plots


def role_grid_values(result: AnalysisResult) -> tuple[list[list[float]], list[list[str]]] | None:
    """(scores, abbreviated role names) per layer × head from profile_heads, when it ran."""
    report = result.reports.get("profile_heads")
    heads = getattr(report, "heads", None)
    if not heads:
        return None
    layers, count = result.maps.entropy.shape
    values = [[0.0] * count for _ in range(layers)]
    names = [[""] * count for _ in range(layers)]
    for item in heads:
        if item.primary_role is None:
            continue
        values[item.layer][item.head] = float(item.scores.get(item.primary_role, 0.0))
        names[item.layer][item.head] = ROLE_ABBREVIATIONS.get(item.primary_role, item.primary_role[:3])
    return values, names


def head_descriptions(result: AnalysisResult) -> list[list[str]]:
    maps = result.maps
    layers, heads = maps.entropy.shape
    info = [
        [
            f"entropy {maps.entropy[l, h]:.2f} nats ({maps.normalised_entropy[l, h]:.0%} of uniform), "
            f"first-token share {maps.first_token_share[l, h]:.0%}, mean max weight {maps.max_weight[l, h]:.2f}"
            for h in range(heads)
        ]
        for l in range(layers)  # noqa: E741
    ]
    profile = result.reports.get("profile_heads")
    for item in getattr(profile, "heads", None) or []:
        if item.primary_role is not None:
            info[item.layer][item.head] += f"; role: {item.primary_role} ({item.scores[item.primary_role]:.2f})"
    return info


CARD_FIELDS = (
    "family",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "scaling",
    "scaling_ratio",
    "positional",
    "mask",
    "max_positions",
    "num_parameters",
)


def model_card(result: AnalysisResult) -> list[tuple[str, Any]]:
    """The page's model card: describe_model's key facts, or nothing when it did not run."""
    description = result.reports.get("describe_model")
    if description is None:
        return []
    return [(key, getattr(description, key)) for key in CARD_FIELDS]


def html_grids(result: AnalysisResult) -> dict[str, dict[str, Any]]:
    """The layer × head grids the page can colour, each with its range and a one-line description."""
    maps = result.maps
    grids: dict[str, dict[str, Any]] = {
        "normalised entropy": {
            "values": maps.normalised_entropy.tolist(),
            "min": 0.0,
            "max": 1.0,
            "description": "mean entropy / log(keys visible)",
        },
        "first-token share": {
            "values": maps.first_token_share.tolist(),
            "min": 0.0,
            "max": 1.0,
            "description": "mean attention on position 0",
        },
        "mean max weight": {
            "values": maps.max_weight.tolist(),
            "min": 0.0,
            "max": 1.0,
            "description": "mean of each query's largest weight",
        },
    }
    role_grid = role_grid_values(result)
    if role_grid is not None:
        grids["primary role"] = {
            "values": role_grid[0],
            "labels": role_grid[1],
            "min": 0.0,
            "max": 1.0,
            "description": "score of each head's primary role",
        }
    return grids


def write_outputs(result: AnalysisResult, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, the PNGs and report.html into ``out_dir``; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report_json = out / "report.json"
    report_json.write_text(json.dumps(result.to_report().model_dump(mode="json"), indent=2, ensure_ascii=False))
    plots = write_pngs(result, out)
    focus = divmod(int(result.maps.normalised_entropy.flatten().argmin()), result.maps.entropy.shape[1])
    html = HtmlReport(
        model=result.model,
        subtitle=f"{len(result.tokens)} tokens: {result.text[:160]}{'…' if len(result.text) > 160 else ''}",
        card=model_card(result),
        tokens=[t.text for t in result.tokens],
        maps=result.maps.maps,
        grids=html_grids(result),
        head_info=head_descriptions(result),
        sections=[(SECTION_TITLES.get(n, n), r) for n, r in result.reports.items()],
        plots=plots,
        initial=(int(focus[0]), int(focus[1])),
    )
    html_path = write_html(html, out / "report.html")
    return {"json": report_json, "html": html_path, **{p.stem: p for _, p in plots}}
