"""The main job's outputs: report.json, readable PNGs, and an HTML page tested in a real headless browser."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from reference import eager_reference

from agent_tools.analysis.metrics import attention_entropy, first_token_share, max_weight
from agent_tools.inspector import Inspector
from agent_tools.report.job import AnalysisReport, run_analysis
from agent_tools.report.outputs import write_outputs

pytestmark = pytest.mark.real_model
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


TEXT = "When Mary and John went to the store, John gave a drink to"


@pytest.fixture(scope="module")
def report_dir(smol, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    result = run_analysis(Inspector(artifact_dir=out), TEXT)
    write_outputs(result, out)
    return out


def test_report_files(report_dir: Path) -> None:
    report = AnalysisReport.model_validate(json.loads((report_dir / "report.json").read_text()))
    assert report.model == "smollm2-135m-instruct"
    assert [len(row) for row in report.head_entropy] == [9] * 30
    assert "describe_model" in report.reports
    pngs = sorted(report_dir.glob("*.png"))
    assert any(p.name.startswith("grid-entropy") for p in pngs)
    assert any(p.name.startswith("head-L") for p in pngs)
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (report_dir / "report.html").read_text()
    assert "http://" not in html and "https://" not in html  # self-contained: nothing fetched


def test_report_grids_equal_the_models_own_attention(report_dir: Path, smol) -> None:
    """The layer × head grids the README and the HTML show are the glossary metrics of the model's eager maps."""
    report = AnalysisReport.model_validate(json.loads((report_dir / "report.json").read_text()))
    encoded = Inspector().encode(smol, TEXT)
    attentions = eager_reference(smol.model, input_ids=encoded.input_ids).attentions
    for layer in (0, 7, 29):
        weights = attentions[layer][0].float()  # (H, T, T)
        assert report.head_entropy[layer] == pytest.approx(attention_entropy(weights).mean(-1).tolist(), abs=2e-4)
        assert report.head_sink_share[layer] == pytest.approx(first_token_share(weights).tolist(), abs=2e-4)
        assert report.head_max_weight[layer] == pytest.approx(max_weight(weights)[0].mean(-1).tolist(), abs=2e-4)


@pytest.mark.skipif(CHROMIUM is None, reason="no Debian chromium (setup.sh installs it as root)")
def test_html_in_headless_chromium(report_dir: Path) -> None:
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1600})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto((report_dir / "report.html").as_uri())
            assert page.locator("#grid td[data-layer]").count() == 30 * 9
            assert page.locator("#tokens .tok").count() > 5
            # The heatmap canvas is drawn (not blank).
            drawn = page.evaluate(
                "() => { const c = document.getElementById('heatmap'); const d = c.getContext('2d')"
                ".getImageData(0, 0, c.width, c.height).data; let n = 0;"
                " for (let i = 0; i < d.length; i += 4) if (d[i] < 250) n++; return n; }"
            )
            assert drawn > 0
            # Selecting a head changes the title; hovering a token changes the readout and the key colours.
            page.select_option("#layer-select", "5")
            page.select_option("#head-select", "2")
            assert "layer 5, head 2" in page.text_content("#head-title")
            page.locator("#grid td[data-layer='7'][data-head='4']").click()
            assert "layer 7, head 4" in page.text_content("#head-title")
            before = page.evaluate("() => document.querySelector('#tokens .tok').style.background")
            page.locator("#tokens .tok").nth(6).hover()
            readout = page.text_content("#readout")
            assert readout.startswith("query 6")
            after = page.evaluate("() => document.querySelector('#tokens .tok').style.background")
            assert after != before
            page.screenshot(path=str(report_dir / "screenshot.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert (report_dir / "screenshot.png").stat().st_size > 10_000
