"""The notebook surface: every tool is an ``Explainer`` method, every report renders itself (HTML and Markdown),
and ``examples/explain_attention.ipynb`` runs from top to bottom with ``nbclient`` (no network), its outputs
stripped in the repository."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

from agent_tools.report.notebook_view import key_figure
from agent_tools.schemas import Finding, Report
from agent_tools.surfaces.notebook import Explainer
from agent_tools.tools import TOOLS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "explain_attention.ipynb"
TINY_TEXT = "the cat sat on the mat because it was tired . and the dog sat"
PNG = "data:image/png;base64,"


def test_every_tool_is_a_method_with_the_tools_arguments() -> None:
    for name, spec in TOOLS.items():
        method = getattr(Explainer, name)
        assert method.__name__ == name and spec.description in (method.__doc__ or "")
        parameters = inspect.signature(method).parameters
        assert set(parameters) - {"self"} == set(spec.input_model.model_fields), name
        if "text" in parameters:
            assert list(parameters)[1] == "text"  # the text may be given first, without its name


def test_methods_return_reports_that_render_themselves(tiny_models) -> None:
    explain = Explainer("tiny-llama")
    collapse = explain.diagnose_collapse(TINY_TEXT)
    assert collapse.model == "tiny-llama"
    html, markdown = collapse._repr_html_(), collapse._repr_markdown_()
    assert collapse.summary.split(".")[0] in html and PNG in html  # summary and key figure
    assert collapse.findings[0].detail[:40] in markdown and "Key figure" in markdown
    shown = explain.show_attention(TINY_TEXT, layer=1, head=0)
    assert PNG in shown._repr_html_()
    with pytest.raises(TypeError, match="by name"):
        explain.show_attention(TINY_TEXT, 1, 0)  # type: ignore[misc]


def test_reports_draw_with_the_registered_renderer_or_plainly(monkeypatch) -> None:
    """schemas.py imports nothing above it: the report layer registers how a report draws itself."""
    from agent_tools import schemas

    report = Report(model="m", summary="a < b", findings=[Finding(kind="k", detail="one finding")])
    monkeypatch.setattr(schemas, "NOTEBOOK_RENDERERS", {})
    assert report._repr_html_() == "<p>a &lt; b</p>"
    assert report._repr_markdown_() == "a < b\n- one finding"
    schemas.register_notebook_renderer("html", lambda r: f"<b>{r.model}</b>")
    assert report._repr_html_() == "<b>m</b>" and report._repr_markdown_() == "a < b\n- one finding"


def test_a_report_without_a_figure_still_renders() -> None:
    report = Report(model="m", summary="two heads differ", findings=[Finding(kind="k", detail="one finding")])
    assert key_figure(report) is None
    assert "two heads differ" in report._repr_html_() and "- one finding" in report._repr_markdown_()


@pytest.mark.real_model
def test_the_notebook_runs_from_top_to_bottom(smol) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert all(
        not c.get("outputs") and c.get("execution_count") is None for c in notebook.cells if c.cell_type == "code"
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the kernel inherits the test's offline, single-thread setting
    client = nbclient.NotebookClient(
        notebook, timeout=110, kernel_name="python3", resources={"metadata": {"path": ROOT}}
    )
    client.execute()  # each cell is bounded by the client's timeout; how long it takes is a benchmark's business
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    markdown = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert len(html) >= 14 and len(markdown) >= 13  # every report and every story step rendered itself
    assert sum(PNG in h for h in html) >= 12  # with its pictures
    assert any("<iframe" in h and "neuron-section" in h for h in html)  # the interactive page
