"""One self-contained HTML file: the story with its pictures, a model view (every head's map as a thumbnail),
the attention view, a neuron view (q, k, q·k, scaled, masked, softmaxed for a chosen query), the findings, the
layer × head grid and the glossary.

No network, no CDN: data, script, style and images are inlined, so the file opens from a USB stick. The
pictures are the ones :mod:`agent_tools.report.figures` drew once for the run.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from importlib.resources import files
from typing import Any

import torch

from agent_tools.render import png_uri
from agent_tools.report.content import head_descriptions, html_grids, model_card, sections, top_heads
from agent_tools.report.figures import draw_pictures
from agent_tools.report.glossary import glossary
from agent_tools.report.job import AnalysisResult, most_collapsed_head
from agent_tools.report.story import build_story, read_first
from agent_tools.report.views import tensor_b64

CARD_TERMS = {"head_dim": "dk", "scaling": "scale", "scaling_ratio": "scale"}  # card key -> glossary key
# The page's size is bounded by these, not by the model: full (T, T) maps for at most FULL_MAP_HEADS heads (the ones
# the story shows), and one max-pooled thumbnail per head, all together within THUMBNAIL_BYTES (side THUMBNAIL_SIDE
# at most, smaller for a model with many heads; none below MIN_THUMBNAIL_SIDE). Every other map: show_attention.
FULL_MAP_HEADS = 8
THUMBNAIL_BYTES = 1024**2
THUMBNAIL_SIDE = 48
MIN_THUMBNAIL_SIDE = 4


def page_for(result: AnalysisResult) -> dict[str, Any]:
    """The page's data for one ``analyze`` run, as the template reads it: every picture drawn once (or reused)."""
    pictures = draw_pictures(result)
    steps = build_story(result)
    in_story = {p.name for step in steps for p in step.pictures}
    description = result.reports.get("describe_model")
    head_info = head_descriptions(result)
    layer, head = most_collapsed_head(result.maps)
    timing = ", ".join(f"{k} {v:.2f} s" for k, v in result.timings.items())
    return {
        "model": result.model,
        "subtitle": f"{len(result.tokens)} tokens: {result.text[:160]}{'…' if len(result.text) > 160 else ''}",
        "card": [[k, v, CARD_TERMS.get(k)] for k, v in model_card(result)],
        "model_summary": description.summary if description is not None else "",
        "read_first": read_first(result),
        "num_layers": len(head_info),
        "num_heads": len(head_info[0]),
        "tokens": [{"text": t.text} for t in result.tokens],
        **page_maps(result.maps.maps, story_heads(result)),
        "grids": html_grids(result),
        "head_info": head_info,
        "initial": {"layer": layer, "head": head},
        "story": [step.as_json() for step in steps],
        "pictures": {name: {"src": png_uri(p.png), "caption": p.caption} for name, p in pictures.items()},
        "more_pictures": [name for name in pictures if name not in in_story],
        "sections": [
            {
                "title": title,
                "question": question,
                "summary": report.summary,
                "findings": [f.model_dump(mode="json") for f in report.findings[:12]],
            }
            for title, question, report in sections(result)
        ],
        "neuron": asdict(result.neuron) if result.neuron is not None else None,  # the page reads q, k, allowed
        "glossary": [t.as_json() for t in glossary()],
        "notes": [f"skipped {name}: {why}" for name, why in result.skipped.items()] + [f"timings: {timing}"],
    }


def story_heads(result: AnalysisResult) -> list[tuple[int, int]]:
    """The heads whose whole map the page keeps: the focus head, then the story's pictured heads (at most
    :data:`FULL_MAP_HEADS`)."""
    chosen = [most_collapsed_head(result.maps)]
    for _why, layer, head in top_heads(result):
        if (layer, head) not in chosen:
            chosen.append((layer, head))
    return chosen[:FULL_MAP_HEADS]


def thumbnail_side(length: int, num_layers: int, num_heads: int) -> int:
    """Pixels per side of every head's thumbnail: at most :data:`THUMBNAIL_SIDE` (or the text's length), and all
    thumbnails within :data:`THUMBNAIL_BYTES`; 0 (no thumbnails) when that leaves fewer than MIN_THUMBNAIL_SIDE."""
    side = min(length, THUMBNAIL_SIDE, math.isqrt(THUMBNAIL_BYTES // max(num_layers * num_heads, 1)))
    return side if side >= MIN_THUMBNAIL_SIDE else 0


def thumbnails(maps: torch.Tensor, side: int) -> torch.Tensor:
    """(L, H, T, T) uint8 maps -> (L, H, side, side) uint8: each pixel the largest weight of its block (peaks stay
    visible), a layer at a time."""
    layers, heads = maps.shape[:2]
    out = torch.zeros(layers, heads, side, side, dtype=torch.uint8)
    for layer in range(layers):
        pooled = torch.nn.functional.adaptive_max_pool2d(maps[layer].float()[:, None], side)  # (H, 1, side, side)
        out[layer] = pooled[:, 0].to(torch.uint8)
    return out


def page_maps(maps: torch.Tensor | None, full_heads: list[tuple[int, int]]) -> dict[str, Any]:
    """The maps the page embeds from (L, H, T, T) uint8 ``maps`` (None: text too long to keep every map; the page
    shows grids only): whole maps of ``full_heads`` (at most :data:`FULL_MAP_HEADS`), every head's thumbnail
    (within the budget)."""
    if maps is None:
        return {"full_heads": [], "full_b64": None, "thumb_side": 0, "thumbs_b64": None}
    heads = full_heads[:FULL_MAP_HEADS]
    full = torch.stack([maps[layer, head] for layer, head in heads]) if heads else maps.new_zeros(0)
    side = thumbnail_side(maps.shape[-1], maps.shape[0], maps.shape[1])
    thumbs = thumbnails(maps, side) if side else None
    return {
        "full_heads": [[layer, head] for layer, head in heads],
        "full_b64": tensor_b64(full),
        "thumb_side": side,
        "thumbs_b64": tensor_b64(thumbs) if thumbs is not None else None,
    }


def render_html(data: dict[str, Any]) -> str:
    """The page as one string: the template with ``data`` (:func:`page_for`) inlined (``</`` escaped so no script
    ends early)."""
    payload = json.dumps(data, ensure_ascii=False).replace("</", "<\\/")
    template = files("agent_tools.report").joinpath("template.html").read_text(encoding="utf-8")
    title = data["model"].replace("<", "&lt;").replace(">", "&gt;")
    return template.replace("__TITLE__", title).replace("__DATA__", payload)
