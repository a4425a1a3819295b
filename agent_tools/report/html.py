"""One self-contained HTML file: summaries, layer × head grids, an interactive attention view, pictures.

No network, no CDN: data, script, style and images are inlined, so the file opens from a USB stick.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch

from agent_tools.schemas import Report


@dataclass
class HtmlReport:
    """What the page shows. ``maps`` is (L, H, T, T) uint8 (weight × 255)."""

    model: str
    subtitle: str
    card: list[tuple[str, Any]]
    tokens: list[str]
    maps: torch.Tensor | None  # None: text too long to keep every map; the page shows grids only
    grids: dict[str, dict[str, Any]]  # name -> {values: L×H floats, description, min?, max?, labels?}
    head_info: list[list[str]]  # L × H one-line description of each head
    sections: list[tuple[str, Report]] = field(default_factory=list)
    plots: list[tuple[str, Path]] = field(default_factory=list)
    initial: tuple[int, int] = (0, 0)


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def render_html(report: HtmlReport) -> str:
    num_layers, num_heads = len(report.head_info), len(report.head_info[0])
    maps = report.maps
    data = {
        "model": report.model,
        "subtitle": report.subtitle,
        "card": [[k, v] for k, v in report.card],
        "num_layers": num_layers,
        "num_heads": num_heads,
        "tokens": [{"text": t} for t in report.tokens],
        "maps_b64": base64.b64encode(maps.contiguous().numpy().tobytes()).decode("ascii") if maps is not None else None,
        "grids": report.grids,
        "head_info": report.head_info,
        "initial": {"layer": report.initial[0], "head": report.initial[1]},
        "sections": [
            {
                "title": title,
                "summary": section.summary,
                "findings": [f.model_dump(mode="json") for f in section.findings[:12]],
            }
            for title, section in report.sections
        ],
        "plots": [{"title": title, "src": _data_uri(path)} for title, path in report.plots],
    }
    payload = json.dumps(data, ensure_ascii=False).replace("</", "<\\/")
    template = files("agent_tools.report").joinpath("template.html").read_text(encoding="utf-8")
    title = report.model.replace("<", "&lt;").replace(">", "&gt;")
    return template.replace("__TITLE__", title).replace("__DATA__", payload)


def write_html(report: HtmlReport, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(report), encoding="utf-8")
    return out
