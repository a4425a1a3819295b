"""Reliability: concurrency gives sequential results, nothing is left behind, weights never change, and any
input to any tool yields a valid report or the tool's error type (property-based)."""

from __future__ import annotations

import hashlib
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_tools.capture import CAPTURE_IMPLEMENTATION
from agent_tools.errors import AttentionToolError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel
from agent_tools.schemas import Report
from agent_tools.tools import TOOLS

TINY = "tiny-llama"
TINY_TEXT = "the cat sat on the mat because it was tired . the dog sat on the mat"


def state_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def hook_counts(model: torch.nn.Module) -> list[tuple[int, int]]:
    """Forward and pre-forward hooks per module (transformers adds its own output recorders once, lazily)."""
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def tiny_arguments(name: str, loaded: LoadedModel) -> dict[str, Any]:
    """The tool's example, moved onto the tiny model (indices clipped into its range, text swapped)."""
    arguments: dict[str, Any] = {**TOOLS[name].example, "model": TINY}
    facts = loaded.facts
    for key, value in list(arguments.items()):
        if key in {"text", "prompt", "prompt_a", "prompt_b"} and isinstance(value, str):
            arguments[key] = TINY_TEXT if key != "prompt_b" else TINY_TEXT.replace("dog", "cat")
        elif key == "layer":
            arguments[key] = min(int(value), facts.num_layers - 1)
        elif key == "head":
            arguments[key] = min(int(value), facts.num_heads - 1)
        elif key == "layers" and isinstance(value, list):
            arguments[key] = sorted({min(int(v), facts.num_layers - 1) for v in value})
        elif key == "heads" and isinstance(value, list):
            arguments[key] = [_clip_head(v, facts) for v in value][:1]
        elif key == "max_new_tokens":
            arguments[key] = min(int(value), 3)
    return arguments


def _clip_head(value: Any, facts: Any) -> Any:
    if isinstance(value, str) and "." in value:
        layer, head = value.split(".")
        return f"{min(int(layer), facts.num_layers - 1)}.{min(int(head), facts.num_heads - 1)}"
    if isinstance(value, dict):
        return {
            "layer": min(int(value["layer"]), facts.num_layers - 1),
            "head": min(int(value["head"]), facts.num_heads - 1),
        }
    return value


def _runnable_on_tiny(name: str) -> bool:
    example = TOOLS[name].example
    return not any(isinstance(v, list) and v and isinstance(v[0], dict) and "role" in v[0] for v in example.values())


TINY_TOOLS = [name for name in TOOLS if _runnable_on_tiny(name) and name != "scaling_experiment"]


@pytest.mark.parametrize("name", TINY_TOOLS)
def test_tool_changes_no_weight_and_leaves_nothing_behind(name: str, tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models["llama"]
    before = state_hash(loaded.model)
    hooks = hook_counts(loaded.model)
    report = TOOLS[name](inspector, tiny_arguments(name, loaded))
    assert isinstance(report, Report)
    assert state_hash(loaded.model) == before
    assert loaded.model.config._attn_implementation != CAPTURE_IMPLEMENTATION
    assert hook_counts(loaded.model) == hooks


def test_concurrent_calls_equal_sequential_and_restore_everything(tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models["llama"]
    ids = torch.arange(6, 20)[None]
    with torch.inference_mode():
        logits_before = loaded.model(input_ids=ids).logits.clone()
    config_before = loaded.model.config.to_dict()
    hooks = hook_counts(loaded.model)
    calls: list[tuple[str, dict[str, Any]]] = []
    for name in TINY_TOOLS:
        calls.append((name, tiny_arguments(name, loaded)))
    calls.append(("show_attention", {"model": TINY, "text": TINY_TEXT, "layer": 7, "head": 0}))  # fails
    calls.append(("show_attention", {"model": TINY, "text": "", "layer": 0, "head": 0}))  # fails
    calls = (calls * (1 + 16 // len(calls)))[:16]

    def run(call: tuple[str, dict[str, Any]]) -> str:
        name, arguments = call
        try:
            return TOOLS[name](inspector, arguments).model_dump_json()
        except AttentionToolError as exc:
            return f"error: {exc.message}"

    sequential = [run(c) for c in calls]
    with ThreadPoolExecutor(max_workers=8) as pool:
        concurrent = list(pool.map(run, calls))
    assert concurrent == sequential
    assert any(r.startswith("error:") for r in concurrent) and any(not r.startswith("error:") for r in concurrent)
    with torch.inference_mode():
        assert torch.equal(loaded.model(input_ids=ids).logits, logits_before)
    assert loaded.model.config.to_dict() == config_before
    assert hook_counts(loaded.model) == hooks
    assert threading.active_count() < 50


def test_budget_and_token_limit_are_named_in_the_error(tiny_models) -> None:
    limited = Inspector(token_limit=5)
    with pytest.raises(AttentionToolError, match="at most 5 tokens"):
        TOOLS["show_attention"](limited, {"model": TINY, "text": TINY_TEXT, "layer": 0, "head": 0})
    tight = Inspector(memory_budget=10)
    with pytest.raises(AttentionToolError, match=r"over the budget of"):
        tight.check_budget(1024**2, "this call")


def _mutations() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-5, max_value=40),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=30),
        st.sampled_from(["", "   ", "\x00\x01", "\ud800", "x" * 5000, "the cat sat", "0.0", "1.1", "99.99"]),
        st.lists(st.integers(min_value=-2, max_value=5), max_size=4),
        st.lists(st.sampled_from(["0.0", "1.1", "0.9", "x"]), max_size=3),
        st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    )


@pytest.mark.parametrize("name", TINY_TOOLS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_input_gives_a_report_or_a_tool_error(name: str, data: st.DataObject, tiny_models) -> None:
    loaded = tiny_models["llama"]
    inspector = Inspector()
    arguments = tiny_arguments(name, loaded)
    fields = sorted(set(TOOLS[name].input_model.model_fields) | {"unknown_argument"})
    for key in data.draw(st.lists(st.sampled_from(fields), max_size=3, unique=True), label="mutated"):
        arguments[key] = data.draw(_mutations(), label=key)
    if arguments.get("model") != TINY:
        arguments["model"] = TINY
    start = time.perf_counter()
    try:
        report = TOOLS[name](inspector, arguments)
    except AttentionToolError as exc:
        assert exc.message and "Traceback" not in exc.message
    else:
        assert isinstance(report, TOOLS[name].output_model)
        _assert_finite_numbers(report.model_dump(mode="json"))
    assert time.perf_counter() - start < 60


def _assert_finite_numbers(value: Any) -> None:
    if isinstance(value, float):
        assert math.isfinite(value), value
    elif isinstance(value, dict):
        for item in value.values():
            _assert_finite_numbers(item)
    elif isinstance(value, list):
        for item in value:
            _assert_finite_numbers(item)
