"""The analyze page's size is bounded by its budget, not by the model: whole maps for the story's heads only and
max-pooled thumbnails within a fixed byte budget, so the page grows with head count only by per-head text."""

from __future__ import annotations

import base64
import json

import torch

from agent_tools.report.html import (
    FULL_MAP_HEADS,
    THUMBNAIL_BYTES,
    page_maps,
    render_html,
    thumbnail_side,
    thumbnails,
)

LENGTH = 96


def _page(num_layers: int, num_heads: int) -> tuple[str, dict]:
    generator = torch.Generator().manual_seed(0)
    maps = torch.randint(0, 256, (num_layers, num_heads, LENGTH, LENGTH), dtype=torch.uint8, generator=generator)
    full_heads = [(layer % num_layers, layer) for layer in range(2 * FULL_MAP_HEADS)]  # more than the page keeps
    data = {
        "model": "tiny",
        "tokens": [{"text": f"t{i}"} for i in range(LENGTH)],
        **page_maps(maps, full_heads),
        "head_info": [["h"] * num_heads for _ in range(num_layers)],
    }
    page = render_html(data)
    start = page.index('<script type="application/json" id="report-data">') + len(
        '<script type="application/json" id="report-data">'
    )
    data = json.loads(page[start : page.index("</script>", start)].replace("<\\/", "</"))
    return page, data


def test_maps_in_the_page_do_not_grow_with_the_head_count() -> None:
    small, small_data = _page(4, 16)
    large, large_data = _page(4, 256)
    for data in (small_data, large_data):
        assert len(data["full_heads"]) == FULL_MAP_HEADS
        assert len(base64.b64decode(data["full_b64"])) == FULL_MAP_HEADS * LENGTH * LENGTH
        thumbs = base64.b64decode(data["thumbs_b64"])
        assert len(thumbs) <= THUMBNAIL_BYTES
    assert small_data["thumb_side"] == 48  # 4 × 16 heads: the largest thumbnail (64 × 48² = 147 KB)
    assert large_data["thumb_side"] == 32  # 4 × 256 heads: isqrt(1 MiB / 1024) = 32
    # 4 × 240 more heads add only their per-head text ("h" and separators: under 8 bytes each), no maps:
    # without the bound the page would carry 960 × 96² = 8.8 MB more bytes of maps
    map_bytes = lambda data: len(data["full_b64"]) + len(data["thumbs_b64"])  # noqa: E731
    assert len(large) - map_bytes(large_data) - (len(small) - map_bytes(small_data)) < 4 * 240 * 8
    assert len(large) < 4 * FULL_MAP_HEADS * LENGTH * LENGTH // 3 + 4 * THUMBNAIL_BYTES // 3 + 200_000


def test_thumbnail_side_keeps_every_thumbnail_within_the_budget() -> None:
    assert thumbnail_side(380, 16, 32) == 45  # 1B shape: isqrt(1 MiB / 512) = 45
    assert thumbnail_side(380, 80, 64) == 14  # 70B shape: 5,120 heads × 14² = 1.0 MB of thumbnails
    assert thumbnail_side(20, 2, 4) == 20  # a short text: its own length
    assert thumbnail_side(380, 1000, 1000) == 0  # too many heads for 4 × 4 pixels: none
    for layers, heads in ((16, 32), (80, 64), (126, 128)):
        side = thumbnail_side(380, layers, heads)
        assert layers * heads * side * side <= THUMBNAIL_BYTES


def test_thumbnails_keep_each_block_peak() -> None:
    maps = torch.zeros(1, 1, 8, 8, dtype=torch.uint8)
    maps[0, 0, 5, 2] = 200  # one peak in block (2, 1) of a 4 × 4 thumbnail
    maps[0, 0, 0, 0] = 50
    pooled = thumbnails(maps, 4)
    expected = torch.zeros(4, 4, dtype=torch.uint8)
    expected[2, 1], expected[0, 0] = 200, 50
    assert torch.equal(pooled[0, 0], expected)
