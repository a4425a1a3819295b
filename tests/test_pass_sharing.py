"""analyze shares forward passes (PassPlan): the same reports as calling each tool alone, in fewer passes."""

from __future__ import annotations

import math

import pytest

from agent_tools.inspector import Inspector, PassPlan
from agent_tools.report.job import run_analysis
from agent_tools.tools import TOOLS

TEXT = "the cat sat on the mat because it was tired and the dog watched it from the door"
SHARED = ("diagnose_collapse", "profile_heads", "explain_scaling", "inspect_projections")


def _comparable(report) -> dict:
    data = report.model_dump(mode="json")
    data.pop("png_path", None)
    return data


def _same(a: object, b: object, path: str = "") -> None:
    """Equal reports, floats to the last rounded digit: the replayed focus layer reads the hidden states of a pass
    that ran every layer in eager math, a call alone runs the layers it does not capture with sdpa (~1e-7 apart)."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, int | float) and isinstance(b, int | float), path
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1.5e-4), (path, a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{index}]")
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_shared_passes_give_the_reports_of_separate_calls(tiny_models, family: str) -> None:
    name = f"tiny-{family}"
    loaded = tiny_models[family]
    lengths: list[int] = []
    base = loaded.model.base_model
    handle = base.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(_length(args, kwargs)), with_kwargs=True
    )
    inspector = Inspector()
    try:
        result = run_analysis(inspector, TEXT, model=name)
    finally:
        handle.remove()
    text_length = inspector.encode(loaded, TEXT).length
    # one pass for the maps + diagnose_collapse + profile_heads' text roles; the focus layer's tools replay that
    # layer's recorded attention call (no second pass through the layers before it) and still give the same reports
    assert lengths.count(text_length) == 1, lengths
    assert set(SHARED) <= set(result.reports), result.skipped
    assert result.timings["capture"] > 0 and result.timings["focus_pass"] > 0
    focus_layer = result.reports["explain_scaling"].layer
    head = result.reports["inspect_projections"].head
    for tool in SHARED:
        arguments = {"text": TEXT, "model": name}
        if tool in ("explain_scaling", "inspect_projections"):
            arguments |= {"layer": focus_layer} | ({"head": head} if tool == "inspect_projections" else {})
        alone = TOOLS[tool](Inspector(), arguments)
        _same(_comparable(alone), _comparable(result.reports[tool]), tool)


def _length(args: tuple, kwargs: dict) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return int(ids.shape[-1])


def test_plans_share_only_the_same_input_and_layers(tiny_models) -> None:
    inspector = Inspector()
    loaded = tiny_models["llama"]
    one, two = inspector.encode(loaded, "the cat sat"), inspector.encode(loaded, "the dog sat")
    plan = PassPlan(loaded, one, [], lambda _output: None, layers=[0, 1])
    assert plan.shares_pass_with(PassPlan(loaded, one, [], lambda _output: None, layers=[0, 1]))
    assert not plan.shares_pass_with(PassPlan(loaded, two, [], lambda _output: None, layers=[0, 1]))
    assert not plan.shares_pass_with(PassPlan(loaded, one, [], lambda _output: None, layers=[1]))
    assert not plan.shares_pass_with(PassPlan(loaded, None, [], lambda _output: None, layers=[0, 1]))
    with pytest.raises(ValueError, match="same model, input and layers"):
        inspector.run_together([plan, PassPlan(loaded, two, [], lambda _output: None, layers=[0, 1])])
