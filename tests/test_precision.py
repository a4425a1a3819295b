"""Any precision, any device: capture stays exact in bfloat16/float16 and under a disk-offloading device map,
and the analyses built on it stay finite and near float32.

The tiny families' q/k projections are scaled ×8 first so that their maps are peaked (rows with a weight above
0.9): on the near-uniform maps of random weights a precision error would hide in the last bits.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from families import build_family, tiny_tokenizer
from reference import KeepAll, eager_reference, output_tensor
from torch import nn

from agent_tools.capture import capture_attention
from agent_tools.consumers.grid import QuantisedMaps
from agent_tools.inspector import Inspector
from agent_tools.loading import forget_model, load_model, register_model
from agent_tools.placement import Placement
from agent_tools.runner import on_device
from agent_tools.tools import get_tool

PARITY_FAMILIES = ("llama", "qwen2", "gemma2", "gpt2", "bert")
LOW_PRECISIONS = (torch.bfloat16, torch.float16)
QK_SCALE = 8.0  # on top of build_family's ×3: logits ×64, so maps are peaked, not near-uniform
PEAKED = 0.9
# Tolerance between a bf16 model's analysis and the float32 model's: the model itself runs in bf16 (weights and
# activations rounded to 8 bits of mantissa), so its maps differ from float32's by ~1e-2 at most on these texts.
BF16_MODEL_TOL = 2e-2
# Tolerances between an analysis of the bf16 model and the float64 reduction of that model's own bf16 maps. An
# analysis may take its entropies from the float32 softmax before the map is rounded to bf16 (as legitimate as the
# rounded map): that moves one row's entropy by up to 2e-3 and a head's mean by up to 2.5e-4 (measured), on top of
# float32 sums and the reports' 4-digit rounding (≤ 5e-5). A bf16 reduction misses by ~1e-2 per mean, 0.15 per row.
REDUCTION_TOL = 1e-3  # means over rows
ROW_TOL = 3e-3  # single rows
TEXT = (
    "the cat sat on the mat because it was tired , and the dog sat on a mat . she was tired because the cat "
    "is on the mat and he is in the dog ."
)


def peaked_family(name: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The tiny family with its query and key projections scaled ×8 (values untouched), cast to ``dtype``."""
    model = build_family(name)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() != 2:
                continue
            if param_name.endswith(("q_proj.weight", "k_proj.weight", "query.weight", "key.weight")):
                param.mul_(QK_SCALE)
            elif param_name.endswith("attn.c_attn.weight"):  # gpt2's Conv1D (in, 3·out): columns q | k | v
                param[:, : 2 * model.config.n_embd].mul_(QK_SCALE)
    return model.to(dtype).eval()


def padded_inputs(name: str) -> dict[str, torch.Tensor]:
    """Two sequences of 16 tokens, the second padded (right for the encoder, left for decoders)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(6, 90, (2, 16), generator=generator)
    mask = torch.ones_like(ids)
    if name == "bert":
        mask[1, -3:] = 0
    else:
        mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def peaked_fraction(weights: torch.Tensor) -> float:
    """Share of the rows that can choose (≥ 2 readable keys) whose largest weight is above 0.9."""
    choosable = (weights > 0).sum(-1) >= 2
    return float((weights.float().amax(-1)[choosable] > PEAKED).float().mean())


# --- capture is exact in every precision -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW_PRECISIONS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", PARITY_FAMILIES)
def test_capture_is_bit_identical_to_eager_in_low_precision(name: str, dtype: torch.dtype) -> None:
    """Captured weights are the model's own eager output_attentions bit for bit, per layer and head.

    Bit-identical, not merely close: the capture runs the families' eager operations in the same order and dtype
    (matmul, ×scaling, soft-cap, + mask, float32 softmax rounded to the model's dtype). GPT-2's eager softmax runs
    in the input dtype, which on the CPU accumulates in float32 and rounds once, so it is equal as well.
    """
    model = peaked_family(name, dtype)
    inputs = padded_inputs(name)
    reference = eager_reference(model, **inputs)
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(model, [keep]):
        captured = model(**inputs)
    assert len(reference.attentions) == len(keep.rows) == model.config.num_hidden_layers
    for layer, expected in enumerate(reference.attentions):
        got = keep.weights(layer)
        assert got.dtype == expected.dtype == dtype and got.shape == expected.shape
        assert torch.isfinite(got).all()
        assert peaked_fraction(expected) > 0.0, f"{name} layer {layer}: no peaked row, parity would see nothing"
        unequal = [head for head in range(got.shape[1]) if not torch.equal(got[:, head], expected[:, head])]
        worst = (got.float() - expected.float()).abs().max().item()
        assert not unequal, f"{name} {dtype} layer {layer} heads {unequal} differ (max {worst:.3e})"
    assert torch.equal(output_tensor(captured), output_tensor(reference))


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2"])
def test_query_chunks_stay_bit_identical_in_bfloat16(name: str) -> None:
    """The inspector chunks query rows on long texts; in bf16 the chunked rows are still the eager ones exactly."""
    model = peaked_family(name, torch.bfloat16)
    inputs = padded_inputs(name)
    reference = eager_reference(model, **inputs)
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(model, [keep], query_chunk=5):
        captured = model(**inputs)
    assert len(keep.rows[0]) == 4  # 16 rows in chunks of 5
    for layer, expected in enumerate(reference.attentions):
        assert torch.equal(keep.weights(layer), expected), f"{name} layer {layer}"
    assert torch.equal(output_tensor(captured), output_tensor(reference))


# --- a device map that offloads layers to disk -------------------------------------------------------------------


@pytest.fixture()
def offloaded(tmp_path: Path):
    """A peaked tiny llama saved to a folder, loaded with layer 1 (of 2) offloaded to disk; and the in-memory model.

    accelerate keeps room for the largest layer on the main device while it streams offloaded weights, so with
    ~99 kB of float32 weights (embedding 12 kB, each layer 37 kB) a 90 kB CPU budget holds the embedding and
    layer 0 and sends layer 1, the final norm and the head to disk.
    """
    model = peaked_family("llama")
    folder = tmp_path / "peaked-llama"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    placement = Placement(
        dtype="float32", device_map="sequential", max_memory={"cpu": "90KB"}, offload_folder=str(tmp_path / "off")
    )
    try:
        loaded = load_model(str(folder), placement)
        yield model, loaded, placement
    finally:
        forget_model(str(folder))


def test_disk_offloaded_capture_equals_the_in_memory_model(offloaded) -> None:
    model, loaded, _ = offloaded
    device_map = loaded.model.hf_device_map
    assert device_map.get("model.layers.0") == "cpu" and device_map.get("model.layers.1") == "disk", device_map
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    inputs = padded_inputs("llama")
    reference = eager_reference(model, **inputs)
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(loaded.model, [keep]):
        captured = loaded.model(**{k: on_device(loaded, v) for k, v in inputs.items()})
    for layer, expected in enumerate(reference.attentions):
        assert peaked_fraction(expected) > 0.0
        diff = (keep.weights(layer) - expected).abs().max().item()
        assert diff <= 1e-5, f"offloaded layer {layer} ({device_map.get(f'model.layers.{layer}')}): {diff:.3e}"
    assert (output_tensor(captured) - output_tensor(reference)).abs().max().item() <= 1e-5


def _floats(value: object, path: str = "") -> dict[str, float]:
    """Every float of a report's plain data, by path (``heads[0].mean_entropy``)."""
    found: dict[str, float] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            found |= _floats(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found |= _floats(item, f"{path}[{index}]")
    elif isinstance(value, float):
        found[path] = value
    return found


def _same_report(tool: str, arguments: dict, offloaded_inspector: Inspector, folder: str, in_memory: str) -> None:
    """The tool's report on the offloaded model has every number of its report on the in-memory model."""
    got = get_tool(tool)(offloaded_inspector, {"model": folder, **arguments}).model_dump()
    expected = get_tool(tool)(Inspector(), {"model": in_memory, **arguments}).model_dump()
    for report in (got, expected):  # the loaded folder runs sdpa by default, the registered original eager
        report.pop("attention_path", None)
    got_floats, expected_floats = _floats(got), _floats(expected)
    assert got_floats.keys() == expected_floats.keys()
    wrong = {k: (v, expected_floats[k]) for k, v in got_floats.items() if abs(v - expected_floats[k]) > 1e-4}
    assert not wrong, f"{tool} on the offloaded model: {len(wrong)} numbers differ, e.g. {list(wrong.items())[:3]}"


@pytest.fixture()
def in_memory(offloaded):
    """The offloaded model's in-memory original, registered as ``prec-in-memory``."""
    model, _, _ = offloaded
    try:
        yield register_model("prec-in-memory", model, tiny_tokenizer()).name
    finally:
        forget_model("prec-in-memory")


def test_tools_run_on_a_disk_offloaded_model(offloaded, in_memory: str) -> None:
    model, loaded, placement = offloaded
    inspector = Inspector(placement=placement)
    assert inspector.model(loaded.name) is loaded  # the inspector's placement finds the cached offloaded model
    view = get_tool("show_attention")(
        inspector, {"model": loaded.name, "text": TEXT, "layer": 1, "head": 0, "detail": "full"}
    )
    ids = tiny_tokenizer()(TEXT, return_tensors="pt")["input_ids"]
    expected = eager_reference(model, input_ids=ids).attentions[1][0, 0]  # layer 1 lives on disk
    entropy = torch.special.entr(expected.double()).sum(-1)
    assert len(view.rows) == ids.shape[1]
    assert max(abs(row.entropy - float(e)) for row, e in zip(view.rows, entropy, strict=True)) <= 1e-4
    assert view.mean_entropy == pytest.approx(float(entropy.mean()), abs=1e-4)
    for tool, arguments in [
        ("show_attention", {"layer": 1, "head": 2}),
        ("explain_scaling", {"layer": 1}),
        ("profile_heads", {}),
        ("ablate_heads", {"heads": ["1.0", "1.3"]}),
        ("diagnose_collapse", {"layers": [0]}),  # layer 0 is in memory; layer 1 (on disk) below
    ]:
        _same_report(tool, {"text": TEXT, **arguments}, inspector, loaded.name, in_memory)


# Tools that read a layer's projection weights get accelerate's meta placeholder for a layer offloaded to disk
# (its weights are loaded only inside the module's forward hook). Line numbers as of this test's writing.
# Tools that read weights (W_O for value norms, W_Q/W_K/W_V to rebuild a head): on a disk-offloaded layer the
# module holds meta placeholders between forwards; layout.materialised loads them through accelerate's hooks.
WEIGHT_READING_TOOLS = ("diagnose_collapse", "inspect_projections", "reconstruct_attention")


@pytest.mark.parametrize("tool", WEIGHT_READING_TOOLS)
def test_weight_reading_tools_on_a_disk_offloaded_layer(offloaded, in_memory: str, tool: str) -> None:
    _, loaded, placement = offloaded
    arguments = {"text": TEXT, "layers": [1]} if tool == "diagnose_collapse" else {"text": TEXT, "layer": 1, "head": 0}
    _same_report(tool, arguments, Inspector(placement=placement), loaded.name, in_memory)


# --- analyses of a bf16 model ------------------------------------------------------------------------------------


@pytest.fixture()
def bf16_and_fp32():
    """The same peaked tiny llama registered twice: ``prec-fp32`` and ``prec-bf16`` (a bf16 copy)."""
    tokenizer = tiny_tokenizer()
    model = peaked_family("llama")
    names = {"fp32": "prec-fp32", "bf16": "prec-bf16"}
    try:
        register_model(names["fp32"], model, tokenizer)
        register_model(names["bf16"], copy.deepcopy(model).to(torch.bfloat16), tokenizer)
        yield names
    finally:
        for name in names.values():
            forget_model(name)


def _own_maps(name: str) -> tuple[torch.Tensor, ...]:
    """The registered model's own eager maps of TEXT, upcast to float64 (the reduction reference)."""
    loaded = load_model(name)
    ids = tiny_tokenizer()(TEXT, return_tensors="pt")["input_ids"]
    return tuple(a[0].double() for a in eager_reference(loaded.model, input_ids=ids).attentions)  # (H, T, T)


def _mean_choosable_entropy(weights: torch.Tensor) -> torch.Tensor:
    """(..., T, T) -> (...): mean row entropy in nats over the rows that see ≥ 2 keys (float64)."""
    entropy = torch.special.entr(weights.double()).sum(-1)
    choosable = ((weights > 0).sum(-1) >= 2).double()
    return (entropy * choosable).sum(-1) / choosable.sum(-1)


def _tool_entropies(name: str) -> dict[str, object]:
    inspector = Inspector()
    full = {"model": name, "text": TEXT, "detail": "full"}  # every row, not the summary's cut
    view = get_tool("show_attention")(inspector, {**full, "layer": 1, "head": 0})
    collapse = get_tool("diagnose_collapse")(inspector, {**full, "top_k": 8})
    scaling = get_tool("explain_scaling")(inspector, {**full, "layer": 1})
    return {
        "show_rows": [row.entropy for row in view.rows],
        "show_mean": view.mean_entropy,
        "collapse": {(h.layer, h.head): h.mean_entropy for h in collapse.heads},
        "collapse_violations": collapse.bound_violations,
        "scaling": [setting.entropy for setting in scaling.settings],
        "scaling_model": next(s.entropy for s in scaling.settings if s.kind == "model_scale"),
        "scaling_monotone": scaling.entropy_monotone,
    }


def test_bf16_model_analyses_are_finite_and_near_float32(bf16_and_fp32: dict[str, str]) -> None:
    fp32, bf16 = _tool_entropies(bf16_and_fp32["fp32"]), _tool_entropies(bf16_and_fp32["bf16"])
    assert load_model(bf16_and_fp32["bf16"]).dtype == torch.bfloat16
    for report in (fp32, bf16):
        values = [*report["show_rows"], report["show_mean"], *report["collapse"].values(), *report["scaling"]]
        assert all(torch.isfinite(torch.tensor(values)))
    assert abs(bf16["show_mean"] - fp32["show_mean"]) <= BF16_MODEL_TOL
    assert fp32["collapse"].keys() == bf16["collapse"].keys()
    assert max(abs(bf16["collapse"][k] - fp32["collapse"][k]) for k in fp32["collapse"]) <= BF16_MODEL_TOL
    assert max(abs(a - b) for a, b in zip(bf16["scaling"], fp32["scaling"], strict=True)) <= BF16_MODEL_TOL
    assert fp32["collapse_violations"] == 0 and fp32["scaling_monotone"]


def test_float32_model_analyses_match_the_float64_reduction(bf16_and_fp32: dict[str, str]) -> None:
    """The sharp check's control: on the float32 model every tool matches a float64 reduction of its maps."""
    _check_reductions(bf16_and_fp32["fp32"], ("show_attention", "diagnose_collapse", "explain_scaling", "grid"))


# Each entry: where the bf16 model's analysis reduces in bf16 (found by the sharp check below; line numbers as
# of this test's writing). The float32 model passes the same check (test above), so the gap is the reduction's.
# grid: row_entropy takes the direct formula for half-precision weights; show_attention: float32 rows, and every
# layer runs eager in half precision (sdpa rounds differently); explain_scaling: one q·k for every sweep setting
# diagnose_collapse: the Zhai-bound check allows the rounding of weights stored in half precision
BF16_TOOLS = ("grid", "show_attention", "explain_scaling", "diagnose_collapse")


@pytest.mark.parametrize("tool", BF16_TOOLS)
def test_bf16_model_analyses_reduce_in_float32(bf16_and_fp32: dict[str, str], tool: str) -> None:
    """Sharp check: the bf16 model's analyses equal a float64 reduction of that model's own bf16 maps.

    Unlike the comparison with the float32 model (which must allow for the model running in bf16), this isolates
    the analysis: the maps are bit-identical to eager, so any gap above float32 rounding is a bf16 reduction.
    """
    _check_reductions(bf16_and_fp32["bf16"], (tool,))


def _check_reductions(name: str, tools: tuple[str, ...]) -> None:
    maps = _own_maps(name)
    report = _tool_entropies(name) if set(tools) - {"grid"} else {}
    if "show_attention" in tools:
        rows = torch.special.entr(maps[1][0]).sum(-1)
        assert max(abs(a - float(b)) for a, b in zip(report["show_rows"], rows, strict=True)) <= ROW_TOL
        assert report["show_mean"] == pytest.approx(float(rows.mean()), abs=REDUCTION_TOL)
    if "diagnose_collapse" in tools:
        for (layer, head), got in report["collapse"].items():
            expected = float(_mean_choosable_entropy(maps[layer][head]))
            assert got == pytest.approx(expected, abs=REDUCTION_TOL), f"layer {layer} head {head}"
        assert report["collapse_violations"] == 0
    if "explain_scaling" in tools:
        choosable = ((maps[1] > 0).sum(-1) >= 2)[0]  # (T,) the same rows in every head (causal)
        expected = float(torch.special.entr(maps[1]).sum(-1)[:, choosable].mean())
        assert report["scaling_model"] == pytest.approx(expected, abs=REDUCTION_TOL)
        assert report["scaling_monotone"]
    if "grid" in tools:
        loaded = load_model(name)
        inspector = Inspector()
        encoded = inspector.encode(loaded, TEXT)
        grid = QuantisedMaps(loaded.facts.num_layers, loaded.facts.num_heads, encoded.length, keep_maps=False)
        inspector.run(loaded, encoded, [grid], need_output=False)
        for layer, weights in enumerate(maps):
            entropy = torch.special.entr(weights).sum(-1).mean(-1)  # (H,) every row, as the grid averages
            assert (grid.entropy[layer].double() - entropy).abs().max() <= REDUCTION_TOL, f"layer {layer}"
            share = weights[..., 0].mean(-1)
            assert (grid.first_token_share[layer].double() - share).abs().max() <= REDUCTION_TOL, f"layer {layer}"


# The tools that rebuild a head from its weights check the rebuild against the model's map and refuse a miss; the
# bound follows the model's dtype (consumers/head_inputs.py REFUSE_ABOVE) and an fp16 mask keeps its hidden keys.
@pytest.mark.parametrize("tool", ["inspect_projections", "reconstruct_attention"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_weight_rebuilding_tools_accept_low_precision_models(dtype: str, tool: str) -> None:
    name = f"prec-rebuild-{dtype}"
    register_model(name, build_family("llama").to(getattr(torch, dtype)), tiny_tokenizer())
    try:
        report = get_tool(tool)(Inspector(), {"model": name, "text": TEXT, "layer": 1, "head": 0})
        assert all(torch.isfinite(torch.tensor(list(_floats(report.model_dump()).values()))))
    finally:
        forget_model(name)


def test_weight_rebuilding_tools_run_on_the_float32_model() -> None:
    """The control of the test above: the same model in float32 rebuilds its map to float32 parity (1e-5)."""
    register_model("prec-rebuild-float32", build_family("llama"), tiny_tokenizer())
    try:
        for tool in ("inspect_projections", "reconstruct_attention"):
            arguments = {"model": "prec-rebuild-float32", "text": TEXT, "layer": 1, "head": 0}
            report = get_tool(tool)(Inspector(), arguments)
            assert 0.0 <= report.model_weight_error <= 1e-5, (tool, report.model_weight_error)  # type: ignore[attr-defined]
    finally:
        forget_model("prec-rebuild-float32")


# --- inputs go to the model's device -----------------------------------------------------------------------------


def test_on_device_keeps_a_tensor_already_there_and_moves_one_that_is_not() -> None:
    loaded = register_model("prec-device", build_family("llama"), tiny_tokenizer())
    try:
        ids = torch.tensor([[0, 6, 7, 8]])
        assert loaded.device == torch.device("cpu")
        assert on_device(loaded, ids) is ids  # no copy when the device matches
        elsewhere = dataclasses.replace(loaded, device=torch.device("meta"))  # the one other device a CPU has
        moved = on_device(elsewhere, ids)
        assert moved.device == torch.device("meta") and moved.shape == ids.shape and ids.device.type == "cpu"
    finally:
        forget_model("prec-device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script benchmarks instead")
def test_gpu_benchmark_without_cuda_says_so_and_exits_0() -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_gpu.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [
        "bench_gpu: no CUDA device here (torch.cuda.is_available() is False); nothing measured"
    ]


def test_path_gap_on_constructed_logits() -> None:
    """Two positions: P = (½, ½) vs Q = (¾, ¼) -> KL = ½ ln(⅔) + ½ ln 2 = 0.143841, same top-1 (index 0);
    P = softmax(2, 0) vs Q = softmax(0, 2) -> KL = 2·(σ(2) − σ(−2)) = 1.523188, top-1 differs."""
    from agent_tools.runner.paths import compare_outputs

    eager = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]])
    own = torch.tensor([[[float(torch.log(torch.tensor(3.0))), 0.0], [0.0, 2.0]]])
    gap = compare_outputs(eager, own, default="sdpa")
    assert gap.tokens == 2 and gap.top1_agreement == 0.5
    assert gap.mean_kl == pytest.approx((0.143841 + 1.523188) / 2, abs=1e-6)
    assert gap.max_kl == pytest.approx(1.523188, abs=1e-6)
    assert gap.max_output_difference == pytest.approx(2.0)
    keep_first = compare_outputs(eager, own, default="sdpa", keep=torch.tensor([True, False]))
    assert keep_first.tokens == 1 and keep_first.top1_agreement == 1.0
    hidden = compare_outputs(eager, own, default="sdpa", logits=False)
    assert hidden.mean_kl is None and hidden.top1_agreement is None and hidden.max_output_difference == 2.0


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_reports_state_the_path_they_explain_and_its_gap_to_the_default(bf16_and_fp32, kind: str) -> None:
    """Every report names the eager path and, against the model's default (sdpa), the measured gap on this text:
    the same numbers as the model's own two forwards give."""
    from agent_tools.analysis.metrics import kl_divergence

    name = bf16_and_fp32[kind]
    loaded = load_model(name)
    loaded.model.config._attn_implementation = "sdpa"  # what from_pretrained gives these families
    report = get_tool("show_attention")(Inspector(), {"model": name, "text": TEXT, "layer": 1, "head": 0})
    path = report.attention_path
    assert path is not None and path.explained == "eager" and path.model_default == "sdpa"
    ids = tiny_tokenizer()(TEXT, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        own = loaded.model(input_ids=ids).logits[0]
    eager = eager_reference(loaded.model, input_ids=ids).logits[0]
    kl = kl_divergence(eager, own)
    assert path.tokens == ids.shape[1]
    assert path.mean_kl == pytest.approx(kl.mean().item(), rel=2e-3, abs=1e-12)
    assert path.top1_agreement == pytest.approx((eager.argmax(-1) == own.argmax(-1)).double().mean().item(), abs=1e-3)
    if kind == "fp32":
        assert path.max_output_difference is not None and path.max_output_difference <= 1e-4
        assert path.top1_agreement == 1.0
    else:
        assert path.max_output_difference is not None and path.max_output_difference > 0  # bf16: sdpa rounds apart


def test_the_path_gap_is_measured_on_the_calls_own_text_when_calls_interleave(bf16_and_fp32) -> None:
    """One inspector serves many clients: a call's report states the gap on its own text, never on the text of a
    call that ran the model in between (each call keeps its own last input)."""
    from agent_tools.session import CallContext, call_scope

    name = bf16_and_fp32["bf16"]
    loaded = load_model(name)
    loaded.model.config._attn_implementation = "sdpa"
    inspector = Inspector()
    short, long = "the cat sat", TEXT
    show = get_tool("show_attention")
    first, second = CallContext(), CallContext()
    with call_scope(first):
        show(inspector, {"model": name, "text": short, "layer": 1, "head": 0})
    with call_scope(second):  # another client's call runs the model on a longer text meanwhile
        report_long = show(inspector, {"model": name, "text": long, "layer": 1, "head": 0})
    with call_scope(first):  # the first call's report is finished after the other call ran
        path = inspector.attention_path(name)
    n_short = tiny_tokenizer()(short, return_tensors="pt")["input_ids"].shape[1]
    assert report_long.attention_path is not None and report_long.attention_path.tokens > n_short
    assert path is not None and path.tokens == n_short


def test_a_long_texts_path_gap_keeps_only_the_last_positions_logits(bf16_and_fp32, monkeypatch) -> None:
    """Over GAP_POSITIONS positions both passes keep only the last ones' logits (not (T, vocabulary) twice), and the
    gap is the one over those positions: the same numbers as the model's own two forwards give there."""
    from agent_tools.analysis.metrics import kl_divergence
    from agent_tools.runner import paths

    monkeypatch.setattr(paths, "GAP_POSITIONS", 4)
    name = bf16_and_fp32["bf16"]
    loaded = load_model(name)
    loaded.model.config._attn_implementation = "sdpa"
    seen: list[int] = []
    hook = loaded.model.get_output_embeddings().register_forward_hook(lambda _m, _i, out: seen.append(out.shape[1]))
    try:
        report = get_tool("show_attention")(Inspector(), {"model": name, "text": TEXT, "layer": 1, "head": 0})
    finally:
        hook.remove()
    path = report.attention_path
    ids = tiny_tokenizer()(TEXT, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 4 and path is not None and path.tokens == 4 and seen.count(4) == 2
    with torch.inference_mode():
        own = loaded.model(input_ids=ids).logits[0, -4:]
    eager = eager_reference(loaded.model, input_ids=ids).logits[0, -4:]
    kl = kl_divergence(eager, own)
    assert path.mean_kl == pytest.approx(kl.mean().item(), rel=2e-3, abs=1e-12)
