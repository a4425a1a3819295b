"""The main job's outputs: report.json, the story and its pictures, readable PNGs, and an HTML page tested in a
real headless browser (the story, the model view, the neuron view, narrow and wide windows, print)."""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from reference import eager_reference

from agent_tools.analysis.metrics import attention_entropy, first_token_share, masked_softmax, max_weight
from agent_tools.cli import build_parser
from agent_tools.inspector import Inspector
from agent_tools.report.glossary import glossary, metric_table
from agent_tools.report.job import AnalysisReport, AnalysisResult, run_analysis
from agent_tools.report.outputs import write_outputs
from agent_tools.report.story import build_story

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
STORY_KEYS = ["raw", "scale", "stages", "no_projections", "collapse", "roles", "training"]


@pytest.fixture(scope="module")
def analysed(smol, tmp_path_factory) -> tuple[AnalysisResult, Path]:
    out = tmp_path_factory.mktemp("report")
    result = run_analysis(Inspector(artifact_dir=out), TEXT)
    write_outputs(result, out)
    return result, out


@pytest.fixture(scope="module")
def report_dir(analysed) -> Path:
    return analysed[1]


def _page_data(report_dir: Path) -> dict:
    page = (report_dir / "report.html").read_text()
    found = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    assert found is not None
    return json.loads(found.group(1).replace("<\\/", "</"))


@pytest.mark.real_model
def test_report_files(report_dir: Path) -> None:
    report = AnalysisReport.model_validate(json.loads((report_dir / "report.json").read_text()))
    assert report.model == "smollm2-135m-instruct"
    assert [len(row) for row in report.head_entropy] == [9] * 30
    assert {"describe_model", "reconstruct_attention", "scaling_experiment"} <= set(report.reports)
    assert [step["key"] for step in report.story] == STORY_KEYS
    pngs = sorted(report_dir.glob("*.png"))
    assert any(p.name.startswith("grid-entropy") for p in pngs)
    assert any(p.name.startswith("head-L") for p in pngs)
    wanted = {picture["name"] for step in report.story for picture in step["pictures"]}
    assert wanted <= {p.stem for p in pngs}  # every story picture was written
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (report_dir / "report.html").read_text()
    assert "http://" not in html and "https://" not in html  # self-contained: nothing fetched


@pytest.mark.real_model
def test_the_model_card_is_shown_once(report_dir: Path) -> None:
    data = _page_data(report_dir)
    assert [row[0] for row in data["card"]][:2] == ["family", "num_layers"]
    assert "Model" not in [section["title"] for section in data["sections"]]  # describe_model is the card


@pytest.mark.real_model
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


@pytest.mark.real_model
def test_the_story_states_this_models_numbers(analysed) -> None:
    result, _ = analysed
    steps = {step.key: step for step in build_story(result)}
    rebuilt = result.reports["reconstruct_attention"]
    assert [s.divisor for s in rebuilt.stages] == pytest.approx([1.0, 8.0, 8.0, 8.0, 8.0])  # ÷ sqrt(d_k = 64)
    assert "stage 2 ÷ 8" in " ".join(steps["stages"].sentences)
    writing = [r for r in result.collapse_rows if r.verdict == "writing_collapse"]
    assert len(result.collapse_rows) == 270
    collapse = " ".join(steps["collapse"].sentences)
    check = result.reports["diagnose_collapse"].check
    assert check is not None and check.heads
    assert collapse.index("Removing each collapsed head") < collapse.index("Value side (norms, not effects)")
    for row in check.heads[:3]:  # the measured kind of each checked head, with its effect, before the norms
        assert f"L{row.layer}H{row.head} is " in collapse and f"{row.mean_ablation.effect:+.4f} nats" in collapse
    for row in writing[:3]:  # each head that writes substantially named, wherever it ranks
        assert f"L{row.layer}H{row.head}" in collapse
    experiment = result.reports["scaling_experiment"]
    assert experiment.confident_wrong_loss == pytest.approx(math.log(math.exp(8) + 15), abs=1e-3)
    assert f"{experiment.chance_loss:.2f}" in " ".join(steps["training"].sentences)
    assert result.probe is not None and len(result.probe.weights) == 65  # [BOS] + 32 random tokens twice
    assert f"L{result.probe.layer}H{result.probe.head}" in " ".join(steps["roles"].sentences)


@pytest.mark.real_model
def test_the_neuron_views_q_and_k_give_the_models_map(analysed) -> None:
    """softmax(q·kᵀ·scale, masked) from the page's q and k equals the captured map of the focus head."""
    result, _ = analysed
    neuron, maps = result.neuron, result.maps.maps
    assert neuron is not None and maps is not None
    shape = (neuron.length, neuron.head_dim)
    q = torch.frombuffer(bytearray(base64.b64decode(neuron.q)), dtype=torch.float32).reshape(shape)
    k = torch.frombuffer(bytearray(base64.b64decode(neuron.k)), dtype=torch.float32).reshape(shape)
    allowed = torch.frombuffer(bytearray(base64.b64decode(neuron.allowed)), dtype=torch.uint8).bool()
    weights = masked_softmax((q @ k.T) * neuron.scale, allowed.reshape(neuron.length, neuron.length))
    captured = maps[neuron.layer, neuron.head].float() / 255
    assert (weights - captured).abs().max() <= 0.5 / 255 + 1e-5


def test_the_glossary_reads_the_metrics_table() -> None:
    table = metric_table()
    assert table["js_divergence"] == ("½ KL(P‖M) + ½ KL(Q‖M), M = ½ (P + Q)", "[0, ln 2]")
    js = next(t for t in glossary() if t.key == "js")
    assert js.formula.startswith(table["js_divergence"][0])
    assert len({t.anchor for t in glossary()}) == len(glossary())


def test_no_experiment_skips_the_training(tiny_models) -> None:
    assert build_parser().parse_args(["analyze", "--no-experiment"]).no_experiment is True
    result = run_analysis(Inspector(), "the cat sat on the mat", model="tiny-llama", experiment=False)
    assert "scaling_experiment" not in result.reports and "scaling_experiment" in result.skipped
    assert [s.key for s in build_story(result)] == STORY_KEYS[:-1]


@pytest.mark.real_model
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
            _check_attention_view(page)
            _check_story(page)
            _check_model_view(page)
            _check_neuron_view(page)
            _check_glossary_links(page)
            page.screenshot(path=str(report_dir / "screenshot.png"), full_page=True)
            _check_widths(browser, report_dir)
        finally:
            browser.close()
    assert errors == []
    assert (report_dir / "screenshot.png").stat().st_size > 10_000


def _check_attention_view(page) -> None:
    assert page.locator("#grid td[data-layer]").count() == 30 * 9
    assert page.locator("#tokens .tok").count() > 5
    # The heatmap canvas is drawn (not blank).
    assert _dark_pixels(page, "#heatmap") > 0
    # Selecting a head changes the title; hovering a token changes the readout and the key colours.
    page.select_option("#layer-select", "5")
    page.select_option("#head-select", "2")
    assert "layer 5, head 2" in page.text_content("#head-title")
    page.locator("#grid td[data-layer='7'][data-head='4']").click()
    assert "layer 7, head 4" in page.text_content("#head-title")
    # The page keeps whole maps for the story's heads only (its size is bounded by budget): another head shows its
    # thumbnail and names show_attention for the whole map
    full = page.evaluate("() => DATA.full_heads")
    assert 1 <= len(full) <= 8
    layer, head = full[-1]
    page.locator(f"#grid td[data-layer='{layer}'][data-head='{head}']").click()
    before = page.evaluate("() => document.querySelector('#tokens .tok').style.background")
    page.locator("#tokens .tok").nth(6).hover()
    assert page.text_content("#readout").startswith("query 6")
    after = page.evaluate("() => document.querySelector('#tokens .tok').style.background")
    assert after != before
    if [7, 4] not in full:
        page.locator("#grid td[data-layer='7'][data-head='4']").click()
        page.locator("#tokens .tok").nth(5).hover()
        assert "show_attention" in page.text_content("#readout")
        assert _dark_pixels(page, "#heatmap") > 0


def _dark_pixels(page, selector: str) -> int:
    return page.evaluate(
        "(s) => { const c = document.querySelector(s); const d = c.getContext('2d')"
        ".getImageData(0, 0, c.width, c.height).data; let n = 0;"
        " for (let i = 0; i < d.length; i += 4) if (d[i] < 250) n++; return n; }",
        selector,
    )


def _check_story(page) -> None:
    """Seven steps in the essay's order, every picture loaded, a picture for every reconstruction stage."""
    keys = page.eval_on_selector_all("#story-steps .step", "els => els.map(e => e.id)")
    assert keys == [f"step-{k}" for k in STORY_KEYS]
    for number in range(1, 6):
        figure = page.locator(f"#step-stages figure[data-picture='story-3-stage-{number}'] img")
        assert figure.count() == 1
    widths = page.eval_on_selector_all("#story-steps img", "els => els.map(e => e.naturalWidth)")
    assert len(widths) >= 16 and min(widths) > 100
    collapse = page.locator("#step-collapse .sentences").text_content()
    assert collapse.count("put nearly all their weight on one key") == 1  # the step is drawn once
    assert "random heads" in collapse  # and states the causal check's baseline, not value norms alone


def _check_model_view(page) -> None:
    """Every head's thumbnail is drawn; a click enlarges it and selects that head."""
    assert page.locator("#model-view canvas").count() == 30 * 9
    assert _dark_pixels(page, "#model-view canvas[data-layer='3'][data-head='1']") > 0
    page.locator("#model-view canvas[data-layer='16'][data-head='0']").click()
    assert page.evaluate("() => document.getElementById('enlarge').open")
    assert page.text_content("#enlarge-title") == "layer 16, head 0"
    assert _dark_pixels(page, "#enlarge-canvas") > 0
    assert "layer 16, head 0" in page.text_content("#head-title")
    page.click("#enlarge-close")
    assert not page.evaluate("() => document.getElementById('enlarge').open")


def _check_neuron_view(page) -> None:
    """The per-key q·k, scaled, masked and softmaxed rows change with the query and match the model's map."""
    rows = page.locator("#neuron-table tr[data-key]")
    assert rows.count() > 5
    before = page.text_content("#neuron-table")
    page.select_option("#neuron-query", "4")
    after = page.text_content("#neuron-table")
    assert after != before
    assert page.locator("#neuron-table tr[data-key]").count() == 5  # keys 0..4 readable, the rest masked
    assert "−∞" in after or "masked" in after
    check = page.text_content("#neuron-check")
    assert float(re.search(r"at most ([0-9]+\.[0-9]+)", check).group(1)) <= 0.01
    page.click("#neuron-next")
    assert page.input_value("#neuron-query") == "5"


def _check_glossary_links(page) -> None:
    anchors = page.eval_on_selector_all("a.term", "els => els.map(e => e.getAttribute('href').slice(1))")
    assert len(anchors) > 20
    ids = set(page.eval_on_selector_all(".glossary dt", "els => els.map(e => e.id)"))
    assert set(anchors) <= ids


def _check_widths(browser, report_dir: Path) -> None:
    """Readable on a phone and a desktop, and in print: nothing wider than the window."""
    for width in (400, 1400):
        page = browser.new_page(viewport={"width": width, "height": 1000})
        page.goto((report_dir / "report.html").as_uri())
        assert page.evaluate("() => document.documentElement.scrollWidth") <= width
        page.screenshot(path=str(report_dir / f"screenshot-{width}.png"), full_page=True)
        page.emulate_media(media="print")
        assert page.evaluate("() => document.documentElement.scrollWidth") <= width
        assert page.evaluate("() => getComputedStyle(document.getElementById('neuron-section')).display") == "none"
        page.close()
