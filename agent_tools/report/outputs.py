"""Files of an ``analyze`` run: report.json, the PNG pictures (drawn once, :mod:`.figures`) and the
self-contained report.html that embeds the same pictures."""

from __future__ import annotations

import json
from pathlib import Path

from agent_tools.files import remove_stale_partials, write_atomic
from agent_tools.report.figures import draw_pictures
from agent_tools.report.html import page_for, render_html
from agent_tools.report.job import AnalysisResult


def write_outputs(result: AnalysisResult, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, the PNGs and report.html into ``out_dir``; return their paths (json, html, then one
    entry per picture, named by its file stem).

    Each file is written whole or not at all (:func:`agent_tools.files.write_atomic`): a run killed while writing
    leaves the previous file or none under each name, never a truncated one.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    report = json.dumps(result.to_report().model_dump(mode="json"), indent=2, ensure_ascii=False)
    report_json = write_atomic(out / "report.json", report)
    pngs = {name: write_atomic(out / f"{name}.png", p.png) for name, p in draw_pictures(result).items()}
    html_path = write_atomic(out / "report.html", render_html(page_for(result)))
    result.written_to = out
    return {"json": report_json, "html": html_path, **pngs}
