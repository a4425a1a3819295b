"""Attribution patching, find_circuit (edge level) and the trace's causal check by attribution in half precision
and on a device map that offloads a layer to disk (issue 26: every precision, and a device map).

Half precision: the backward runs in the model's dtype (bfloat16 keeps float32's exponent range, so no gradient
underflows; float16 multiplies the metric by a loss scale of 4096 first) and every sum is float64; the reports say
so (``gradient_dtype``). What rounding costs is stated as tolerances against the same weights in float32, measured
here: head estimates within 0.05 of the gap (bfloat16 0.025, float16 0.006 measured), exact restored fractions
within 0.05 (0.023, 0.007), the hand-set circuit's edges the same in bfloat16 with EAP-IG scores within 20% (14% on
the K-composition edge through a softmax saturated at score 1e5), the tiny llama's in float16 within 0.02 (0.005).

Device map: the same weights loaded with ``device_map="sequential"`` and a 90 kB CPU budget, so accelerate keeps
the embedding and layer 0 in memory and streams layer 1, the final norm and the head from disk: every number
equals the in-memory model's (to the reports' 4-decimal rounding).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from crafted import circuit_tokenizer, induction_circuit
from families import build_family, tiny_tokenizer

from agent_tools.errors import UnsupportedModelError
from agent_tools.inspector import Inspector
from agent_tools.loading import Placement, forget_model, load_model, register_model
from agent_tools.tools import get_tool

PAIR = {"clean": "the cat sat on the mat because it", "corrupted": "the dog sat on the mat because it"}
ANSWERS = {"answer": "w59", "wrong": "w32"}  # the float32 model's own (its clean and corrupted top tokens)
CIRCUIT = {"clean": "cat dog sun moon cat", "corrupted": "sun dog cat moon cat", "answer": "dog", "wrong": "moon"}
TRACE_TEXT = "cat sat on the mat because it was tired and the dog ran to the park"
TRACE_SEGMENTS = ["cat sat", "on the mat", "because it", "was tired", "and the dog", "ran to the park"]
ROUNDING = 2e-4  # reports round to 4 decimals


def _patch(inspector: Inspector, model: str) -> dict[tuple[int, int], tuple[float, float]]:
    report = get_tool("patch_heads")(inspector, {**PAIR, "model": model, "method": "attribution", "detail": "full"})
    assert report.attribution is not None
    return {(h.layer, h.head): (h.estimate, h.restored) for h in report.heads}


def _edges(report) -> dict[tuple[str, str, str], float]:
    return {(e.sender, e.receiver, e.kind): e.score for e in report.edges}


HALF = [(torch.bfloat16, "bfloat16 (sums in float64)"), (torch.float16, "float16 (loss scale 4096, sums in float64)")]


@pytest.mark.parametrize(("dtype", "note"), HALF)
def test_half_precision_attribution_agrees_with_float32_within_the_stated_tolerance(
    dtype: torch.dtype, note: str, inspector: Inspector
) -> None:
    model = build_family("llama")
    register_model("precision-f32", model, tiny_tokenizer())
    register_model("precision-half", copy.deepcopy(model).to(dtype), tiny_tokenizer())
    arguments = {**PAIR, "method": "attribution", "detail": "full"}
    half = get_tool("patch_heads")(inspector, {**arguments, "model": "precision-half"})
    assert half.attribution is not None and half.attribution.gradient_dtype == note
    full = _patch(inspector, "precision-f32")
    rounded = {(h.layer, h.head): (h.estimate, h.restored) for h in half.heads}
    assert full.keys() == rounded.keys() and len(full) == 8
    for head, (estimate, restored) in full.items():
        assert rounded[head][0] == pytest.approx(estimate, abs=0.05), head
        assert rounded[head][1] == pytest.approx(restored, abs=0.05), head
    ranked = sorted(full, key=lambda h: -full[h][0])[:3]
    assert sorted(rounded, key=lambda h: -rounded[h][0])[:3] == ranked  # the estimate's top 3, in order


def test_bfloat16_find_circuit_finds_the_hand_set_circuit(inspector: Inspector) -> None:
    register_model("circuit-f32", induction_circuit(), circuit_tokenizer())
    register_model("circuit-bf16", induction_circuit().to(torch.bfloat16), circuit_tokenizer())
    full = get_tool("find_circuit")(inspector, {**CIRCUIT, "model": "circuit-f32", "detail": "full"})
    half = get_tool("find_circuit")(inspector, {**CIRCUIT, "model": "circuit-bf16", "detail": "full"})
    assert half.gradient_dtype == "bfloat16 (sums in float64)" and full.gradient_dtype == "float32 (sums in float64)"
    expected = {("L0H0", "L1H0", "K"), ("embeddings", "L0H0", "V"), ("L1H0", "logits", "direct")}
    assert _edges(full).keys() == _edges(half).keys() == expected
    for edge, score in _edges(full).items():
        assert _edges(half)[edge] == pytest.approx(score, rel=0.2), edge
    assert half.faithfulness_method.startswith("edge-level (exact edge patching)")
    assert half.circuit_edges == full.circuit_edges == 3
    assert half.faithfulness == pytest.approx(full.faithfulness, abs=0.02)
    assert [p.faithfulness for p in half.curve[:3]] == pytest.approx([0.0, 0.0, 1.0], abs=0.02)


def test_float16_find_circuit_agrees_with_float32(inspector: Inspector) -> None:
    """The hand-set circuit's scores of 1e5 overflow float16 (its forward is not finite there), so float16 edges
    are checked on the tiny llama: the same edges and circuit, scores within 0.02 of the gap (0.005 measured)."""
    model = build_family("llama")
    register_model("circuit-llama-f32", model, tiny_tokenizer())
    register_model("circuit-llama-f16", copy.deepcopy(model).to(torch.float16), tiny_tokenizer())
    arguments = {**PAIR, **ANSWERS, "detail": "full"}
    full = get_tool("find_circuit")(inspector, {**arguments, "model": "circuit-llama-f32"})
    half = get_tool("find_circuit")(inspector, {**arguments, "model": "circuit-llama-f16"})
    assert half.gradient_dtype == "float16 (loss scale 4096, sums in float64)"
    assert _edges(half).keys() == _edges(full).keys() and len(_edges(full)) > 0
    for edge, score in _edges(full).items():
        assert _edges(half)[edge] == pytest.approx(score, abs=0.02), edge
    assert (half.ranking, half.circuit_edges) == (full.ranking, full.circuit_edges)
    assert half.faithfulness == pytest.approx(full.faithfulness, abs=0.02)


@pytest.fixture()
def offloaded_llama(tmp_path: Path):
    """A tiny llama in memory, and the same weights loaded with layer 1, the final norm and the head on disk; the
    folder and an inspector whose placement is that device map (float32 named: ``auto`` is bfloat16 on a CPU with
    bfloat16 hardware, where the halved weights fit the 90 kB budget and nothing goes to disk)."""
    model = build_family("llama")
    register_model("offload-reference", model, tiny_tokenizer())
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    placement = Placement(
        dtype="float32", device_map="sequential", max_memory={"cpu": "90KB"}, offload_folder=str(tmp_path / "off")
    )
    try:
        loaded = load_model(str(folder), placement)
        assert loaded.model.hf_device_map.get("model.layers.1") == "disk", loaded.model.hf_device_map
        yield str(folder), Inspector(placement=placement)
    finally:
        forget_model(str(folder))


def test_on_a_device_map_attribution_and_find_circuit_equal_the_in_memory_model(
    offloaded_llama: tuple[str, Inspector],
) -> None:
    offloaded, inspector = offloaded_llama
    reference, mapped = _patch(inspector, "offload-reference"), _patch(inspector, offloaded)
    assert reference.keys() == mapped.keys()
    for head, values in reference.items():
        assert mapped[head] == pytest.approx(values, abs=ROUNDING), head
    circuit = {**PAIR, **ANSWERS, "detail": "full"}
    in_memory = get_tool("find_circuit")(inspector, {**circuit, "model": "offload-reference"})
    on_disk = get_tool("find_circuit")(inspector, {**circuit, "model": offloaded})
    assert on_disk.faithfulness_method.startswith("edge-level (exact edge patching)")
    assert _edges(on_disk).keys() == _edges(in_memory).keys() and len(_edges(in_memory)) > 0
    for edge, score in _edges(in_memory).items():
        assert _edges(on_disk)[edge] == pytest.approx(score, abs=ROUNDING), edge
    assert on_disk.circuit_edges == in_memory.circuit_edges
    assert on_disk.faithfulness == pytest.approx(in_memory.faithfulness, abs=ROUNDING)


def test_on_a_device_map_the_traces_causal_check_equals_the_in_memory_model(
    offloaded_llama: tuple[str, Inspector],
) -> None:
    offloaded, inspector = offloaded_llama
    segments = [{"name": f"s{i}", "text": text} for i, text in enumerate(TRACE_SEGMENTS)]
    arguments = {"prompt": TRACE_TEXT, "segments": segments, "detail": "full", "checks": ["causal"]}
    trace = get_tool("trace_prompt_attention")
    in_memory = trace(inspector, {**arguments, "model": "offload-reference"}).causal_attribution
    on_disk = trace(inspector, {**arguments, "model": offloaded}).causal_attribution
    assert in_memory is not None and on_disk is not None and len(in_memory.checked) == 4
    assert [(r.segment, r.chosen) for r in on_disk.checked] == [(r.segment, r.chosen) for r in in_memory.checked]
    for disk, memory in zip(on_disk.checked, in_memory.checked, strict=True):
        assert (disk.exact, disk.estimate) == pytest.approx((memory.exact, memory.estimate), abs=ROUNDING)


OVERFLOW_CALLS = {
    "find_circuit": CIRCUIT,
    "patch_heads": CIRCUIT,
    "show_attention": {"text": CIRCUIT["clean"], "layer": 1, "head": 0},
    "ablate_heads": {"text": CIRCUIT["clean"], "heads": ["0.0"]},
}


@pytest.mark.parametrize("tool", sorted(OVERFLOW_CALLS))
def test_a_float16_overflow_is_a_tool_error_naming_the_precision(tool: str, inspector: Inspector) -> None:
    """The hand-set circuit's scores of 1e5 overflow float16: its own forward is NaN, so every number would be.
    Each tool answers with an UnsupportedModelError naming float16 and the precisions that hold (before: a
    RuntimeError "non-finite number", or "atol must be greater than or equal to zero, but got -nan")."""
    register_model("circuit-overflow-f16", induction_circuit().to(torch.float16), circuit_tokenizer())
    with pytest.raises(UnsupportedModelError, match=r"'circuit-overflow-f16' overflows float16 on this input") as info:
        get_tool(tool)(inspector, {**OVERFLOW_CALLS[tool], "model": "circuit-overflow-f16"})
    assert "bfloat16 (float32's range) or float32 (--dtype)" in info.value.message and info.value.field == "model"


def test_a_bug_on_a_finite_model_still_raises(inspector: Inspector, monkeypatch: pytest.MonkeyPatch) -> None:
    """The overflow diagnosis only names float16 when the model's own forward is not finite: a float32 model's
    failure stays the bug it is, and so does a float16 model's whose forward is finite."""
    register_model("circuit-finite-f32", induction_circuit(), circuit_tokenizer())
    register_model("finite-llama-f16", build_family("llama").to(torch.float16), tiny_tokenizer())
    spec = get_tool("show_attention")

    def broken(data: object) -> object:  # the pass ran (its input recorded), then the report fails
        raise RuntimeError("a bug")

    for model, text in (("circuit-finite-f32", CIRCUIT["clean"]), ("finite-llama-f16", PAIR["clean"])):
        monkeypatch.setattr(spec.output_model, "model_validate", broken)
        with pytest.raises(RuntimeError, match="a bug"):
            spec(inspector, {"text": text, "layer": 1, "head": 0, "model": model})
        monkeypatch.undo()


def test_a_pair_tools_path_gap_is_measured_on_its_own_clean_prompt(inspector: Inspector) -> None:
    """patch_heads runs its clean prompt through patching passes, not through the inspector's captured run; the
    report's attention-path gap is still measured on that prompt, never on the text an earlier call ran."""
    model = build_family("llama")
    model.set_attn_implementation("sdpa")  # the model's own path differs from the eager one explained: a gap
    register_model("gap-llama", model, tiny_tokenizer())
    longer = "the cat sat on the mat because it was tired and the dog ran to the park after lunch"
    get_tool("show_attention")(inspector, {"text": longer, "layer": 0, "head": 0, "model": "gap-llama"})
    report = get_tool("patch_heads")(inspector, {**PAIR, **ANSWERS, "model": "gap-llama", "method": "exact"})
    clean_tokens = inspector.encode(inspector.model("gap-llama"), PAIR["clean"]).length
    assert report.attention_path is not None and report.attention_path.tokens == clean_tokens
