"""Host synchronisations of a tool call do not grow with the number of query chunks (O(layers), not O(chunks)).

On an accelerator every tensor-to-Python conversion (``bool()``, ``int()``, ``float()``, ``.item()``, ``.tolist()``),
every ``nonzero`` or boolean-mask index and every device-to-host copy waits for the device. The CPU has no such
waits, so the tests count the calls themselves: the conversions and copies are patched to count, a tool runs on a
tiny model with a forced small query chunk, and again with half that chunk (twice the chunks) — the counts must be
equal. Conversions of CPU-side results after the pass count too; they do not depend on the chunk either.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from families import build_family, tiny_tokenizer

import agent_tools.consumers as consumers_package
from agent_tools.capture import capture_attention
from agent_tools.consumers import collapse as collapse_module
from agent_tools.consumers import host
from agent_tools.consumers import scaling as scaling_module
from agent_tools.consumers.collapse import CollapseConsumer
from agent_tools.consumers.scaling import ScalingConsumer
from agent_tools.inspector import Inspector
from agent_tools.loading import register_model
from agent_tools.tools import get_tool

TEXT = " ".join(["the cat sat on the mat and the dog ran"] * 4)  # ~40 tokens: 10 chunks of 4, 20 of 2
CONVERSIONS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu")


class SyncCounter:
    """Counts conversions and copies while ``active``; ``counts`` by kind."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.active = False

    def wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.counts[name] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def getitem(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, index: Any) -> Any:
            items = index if isinstance(index, tuple) else (index,)
            if self.active and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
                self.counts["boolean index"] += 1
            return original(tensor, index)

        return counted

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@pytest.fixture()
def counter(monkeypatch: pytest.MonkeyPatch) -> Iterator[SyncCounter]:
    counting = SyncCounter()
    for name in CONVERSIONS:
        monkeypatch.setattr(torch.Tensor, name, counting.wrap(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.Tensor, "__getitem__", counting.getitem(torch.Tensor.__getitem__))
    to_host = counting.wrap("to_host", host.to_host)
    for module in pkgutil.iter_modules(consumers_package.__path__):
        loaded = importlib.import_module(f"agent_tools.consumers.{module.name}")
        if getattr(loaded, "to_host", None) is host.to_host:
            monkeypatch.setattr(loaded, "to_host", to_host)
    monkeypatch.setattr(host, "to_host", to_host)
    yield counting


@pytest.fixture(scope="module")
def tiny_llama() -> str:
    register_model("tiny-llama-syncs", build_family("llama"), tiny_tokenizer())
    return "tiny-llama-syncs"


def _counts(
    counter: SyncCounter,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tool: str,
    arguments: dict[str, Any],
    chunk: int,
) -> collections.Counter[str]:
    monkeypatch.setattr(Inspector, "query_chunk", lambda self, loaded, length: chunk)
    inspector = Inspector(artifact_dir=tmp_path / f"chunk-{chunk}")
    get_tool(tool)(inspector, _warm(arguments))  # loading and first-call caches are not the pass; another text
    counter.counts.clear()
    counter.active = True
    try:
        get_tool(tool)(inspector, arguments)
    finally:
        counter.active = False
    return collections.Counter(counter.counts)


def _warm(arguments: dict[str, Any]) -> dict[str, Any]:
    """The same call on other prompts (a repeated call could be answered from a cache without a pass)."""
    if "clean" in arguments:  # the pair swapped: the same tokens, the other run recorded
        return {**arguments, "clean": arguments["corrupted"], "corrupted": arguments["clean"]}
    return {**arguments, "text": f"{arguments['text']} and then"}


CALLS = {
    "diagnose_collapse": {"text": TEXT, "causal_check": False},
    "diagnose_collapse+check": {"text": TEXT},
    "show_attention": {"text": TEXT, "layer": 1, "head": 0},
    "patch_heads": {
        "clean": "the cat sat on the mat and the cat",
        "corrupted": "the dog sat on the mat and the dog",
        "method": "exact",
    },
    "profile_heads": {"text": TEXT},
    "explain_scaling": {"text": TEXT, "layer": 1},
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_host_synchronisations_do_not_grow_with_query_chunks(
    call: str, tiny_llama: str, counter: SyncCounter, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tool = call.split("+")[0]
    arguments = {"model": tiny_llama, **CALLS[call]}
    coarse = _counts(counter, monkeypatch, tmp_path, tool, arguments, chunk=4)
    fine = _counts(counter, monkeypatch, tmp_path, tool, arguments, chunk=2)
    assert sum(coarse.values()) > 0  # the counter sees the call's conversions
    assert fine == coarse, f"{tool}: {dict(coarse)} with chunks of 4 rows, {dict(fine)} with chunks of 2"


def test_the_counter_sees_a_conversion_per_chunk(counter: SyncCounter) -> None:
    """The harness itself: a loop that reads a number per chunk is counted once per chunk."""
    weights = torch.rand(8, 8)
    counter.active = True
    for start in range(0, 8, 2):
        float(weights[start : start + 2].sum())
        bool((weights[start : start + 2] > 0.5).any())
        weights[weights > 2.0]
    counter.active = False
    assert counter.counts == {"__float__": 4, "__bool__": 4, "boolean index": 4}


def test_sums_on_an_accelerator_are_float32_and_agree_with_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an accelerator the consumers' running sums are float32 (float64 is slow there): the collapse and scale
    statistics they give agree with the CPU's float64 sums to float32 rounding."""
    assert host.accumulation_dtype(torch.device("cpu")) == torch.float64
    assert host.accumulation_dtype(torch.device("cuda", 0)) == torch.float32
    model = build_family("llama")
    ids = torch.tensor([[0, 7, 9, 30, 11, 5, 31, 7, 9, 30, 11, 5]])

    def run() -> tuple[list[Any], list[Any]]:
        sinks = torch.zeros(ids.shape[1], dtype=torch.bool)
        sinks[0] = True
        collapse = CollapseConsumer(sinks)
        scaling = ScalingConsumer(1, range(4), [0.5, 2.0], model_scale=0.25)
        with torch.inference_mode(), capture_attention(model, [collapse, scaling], query_chunk=3):
            model(input_ids=ids)
        rows = [dataclasses.astuple(row) for row in collapse.results()]
        sums = [setting.sums for setting in scaling.settings] + [scaling.variances()["raw_variance"].tolist()]
        return rows, sums

    wide = run()
    for module in (collapse_module, scaling_module, host):
        monkeypatch.setattr(module, "accumulation_dtype", lambda device: torch.float32)
    narrow = run()
    assert narrow[0][0] != wide[0][0] or narrow[1] != wide[1]  # float32 sums did run
    assert _flat(narrow) == pytest.approx(_flat(wide), rel=1e-5, abs=1e-6)


def _flat(value: Any) -> list[float]:
    if isinstance(value, dict):
        return [x for key in sorted(value) for x in _flat(value[key])]
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _flat(item)]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    return [float(value)]
