"""Placement: the operator's dtype / device / device-map choices are checked, estimated and carried out."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from families import tiny_tokenizer

from agent_tools import placement as pl
from agent_tools.errors import InvalidInputError, ModelNotFoundError, ResourceLimitError
from agent_tools.loading import (
    _gguf_target,
    forget_model,
    load_model,
    loaded_models,
    register_model,
    resolve_reference,
)
from agent_tools.placement import (
    ATTENTION_BLOCK_BYTES,
    Placement,
    attention_block_bytes,
    cache_key,
    check_fits,
    checkpoint_bytes,
    estimate_memory,
    from_pretrained_kwargs,
    make_placement,
    meta_model,
    parse_max_memory,
    query_chunk_rows,
    resolve_device,
    resolve_dtype,
    size_bytes,
)
from agent_tools.settings import readable_size

LLAMA_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80}
LLAMA_70B["num_attention_heads"] = 64
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "max_position_embeddings": 64,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 1,
}
TINY_PARAMS = 96 * 64 * 2 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64


@pytest.fixture()
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """One pretend CUDA device: enough for the rules that only read availability (nothing is put on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.fixture()
def tiny_folder(tmp_path: Path) -> Path:
    """A random tiny Llama saved as a Hugging Face folder (config, safetensors, tokenizer)."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY))
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_parse_max_memory_good() -> None:
    assert parse_max_memory("0=70GiB,1=70GiB,cpu=100GiB") == {0: "70GiB", 1: "70GiB", "cpu": "100GiB"}
    assert parse_max_memory(" CPU = 1.5 GB , disk=1TB") == {"cpu": "1.5GB", "disk": "1TB"}
    assert size_bytes("70GiB") == 70 * 2**30
    assert size_bytes("1.5GB") == 1_500_000_000
    assert size_bytes("512KiB") == 524_288
    assert size_bytes("1000") == 1000


@pytest.mark.parametrize(
    "text", ["", "cpu", "gpu=1GiB", "cpu=abc", "cpu=0GiB", "cpu=1GiB,cpu=2GiB", "cpu=5 parsecs", "=1GiB"]
)
def test_parse_max_memory_bad_names_the_form(text: str) -> None:
    with pytest.raises(InvalidInputError, match=r"use comma-separated DEVICE=SIZE pairs, e\.g\. 0=70GiB") as info:
        parse_max_memory(text)
    assert info.value.field == "max_memory" and "\n" not in info.value.message


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"dtype": "float8"}, r"unknown dtype 'float8'; valid: auto, float32, bfloat16, float16"),
        ({"device": "tpu"}, r"unknown device 'tpu'; valid: auto, cpu, cuda, cuda:N, mps"),
        ({"device": "cpu:1"}, r"unknown device 'cpu:1'; valid: auto, cpu, cuda, cuda:N, mps"),
        ({"device": "cuda"}, r"device 'cuda' needs CUDA, which this machine lacks; valid here: auto, cpu$"),
        ({"device": "cuda:0"}, r"needs GPU 0 \(it has 0 CUDA devices\).*valid here: auto, cpu$"),
        ({"device": "mps"}, r"device 'mps' needs MPS, which this machine lacks; valid here: auto, cpu$"),
        ({"device_map": "everywhere"}, r"unknown device_map 'everywhere'; valid: auto, balanced, sequential"),
        ({"device": "cpu", "device_map": "auto"}, r"give a device \('cpu'\) or a device map \('auto'\), not both"),
        ({"max_memory": "cpu=1GiB"}, r"only apply with a device map; add one of: auto, balanced, sequential"),
        ({"device_map": "auto", "max_memory": "0=1GiB"}, r"names GPU 0, but this machine has 0 CUDA devices"),
        ({"quantization": "2bit"}, r"unknown quantization '2bit'; valid: 8bit, 4bit"),
        ({"quantization": "4bit"}, r"'4bit' needs a CUDA GPU.*valid with CUDA: 8bit, 4bit"),
    ],
)
def test_bad_placements_name_what_is_valid(kwargs: dict[str, str], pattern: str) -> None:
    assert not torch.cuda.is_available()  # this machine: the refusals below are real, not simulated
    with pytest.raises(InvalidInputError, match=pattern) as info:
        make_placement(**kwargs)
    assert "\n" not in info.value.message


def test_quantization_without_bitsandbytes_says_how_to_install(fake_cuda: None) -> None:
    if importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("bitsandbytes is installed here")
    with pytest.raises(InvalidInputError, match=r"needs bitsandbytes: pip install attention-explainer\[quantized\]"):
        make_placement(quantization="8bit")
    with pytest.raises(InvalidInputError, match="runs on CUDA only"):
        Placement(device="cpu", quantization="4bit").validate()


def test_offload_folder_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(InvalidInputError, match=r"offload folder .* cannot be created or written .*writable folder"):
        make_placement(device_map="auto", offload_folder=str(blocker / "offload"))
    good = make_placement(device_map="auto", offload_folder=str(tmp_path / "new" / "offload"))
    assert (tmp_path / "new" / "offload").is_dir() and good.offload_folder == str(tmp_path / "new" / "offload")
    assert list((tmp_path / "new" / "offload").iterdir()) == []  # the write probe is cleaned up


def test_resolution_on_this_machine() -> None:
    default = make_placement()
    assert resolve_device(default) == "cpu"
    assert resolve_dtype(default, tf.LlamaConfig(dtype="bfloat16")) == torch.float32  # auto on the CPU = float32
    assert resolve_dtype(Placement(dtype="bfloat16"), None) == torch.bfloat16
    assert resolve_dtype(Placement(dtype="float16", device="cpu"), None) == torch.float16
    assert from_pretrained_kwargs(default, tf.LlamaConfig()) == {"dtype": torch.float32}
    assert default.key == "auto@auto" and cache_key(default) == "float32@cpu"
    assert cache_key(Placement(dtype="float32", device="cpu")) == cache_key(default)
    assert Placement(dtype="bfloat16", device="cpu").key == "bfloat16@cpu"


def test_resolution_on_an_accelerator(fake_cuda: None) -> None:
    auto = Placement()
    assert resolve_device(auto) == "cuda"
    assert resolve_dtype(auto, tf.LlamaConfig(dtype="bfloat16")) == torch.bfloat16  # the checkpoint's own
    assert resolve_dtype(auto, tf.LlamaConfig(dtype=torch.float16)) == torch.float16
    assert resolve_dtype(auto, tf.LlamaConfig()) == torch.float32  # no dtype recorded: float32
    assert resolve_dtype(auto, None) == torch.float32
    assert resolve_dtype(Placement(device="cpu"), tf.LlamaConfig(dtype="bfloat16")) == torch.float32
    kwargs = from_pretrained_kwargs(Placement(device="cuda:0"), tf.LlamaConfig(dtype="bfloat16"))
    assert kwargs == {"dtype": torch.bfloat16, "device_map": {"": "cuda:0"}}
    assert from_pretrained_kwargs(auto, None)["device_map"] == {"": "cuda"}
    assert cache_key(auto) == "auto@cuda"


def test_device_map_kwargs_pass_through(tmp_path: Path) -> None:
    placement = make_placement(
        dtype="bfloat16", device_map="balanced", max_memory="cpu=2GiB,disk=1TB", offload_folder=str(tmp_path)
    )
    kwargs = from_pretrained_kwargs(placement, None)
    assert kwargs == {
        "dtype": torch.bfloat16,
        "device_map": "balanced",
        "max_memory": {"cpu": 2 * 2**30, "disk": 10**12},
        "offload_folder": str(tmp_path),
    }
    assert placement.key == "bfloat16@auto/map=balanced/mem=cpu=2GiB,disk=1TB/offload"


def test_quantization_kwargs(fake_cuda: None) -> None:
    kwargs = from_pretrained_kwargs(Placement(quantization="4bit"), tf.LlamaConfig(dtype="bfloat16"))
    config = kwargs["quantization_config"]
    assert config.load_in_4bit and config.bnb_4bit_compute_dtype == torch.bfloat16
    assert from_pretrained_kwargs(Placement(quantization="8bit"), None)["quantization_config"].load_in_8bit


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_llama_8b_and_70b_estimates_from_config_alone() -> None:
    config_8b, config_70b = tf.LlamaConfig(**LLAMA_8B), tf.LlamaConfig(**LLAMA_70B)
    before = _rss_bytes()
    bf16_8b = estimate_memory(config_8b, torch.bfloat16).weights
    fp32_8b = estimate_memory(config_8b, torch.float32).weights
    bf16_70b = estimate_memory(config_70b, torch.bfloat16).weights
    assert _rss_bytes() - before < 1024**3  # a real 70B would be 141 GB: nothing was allocated
    assert bf16_8b == pytest.approx(16.06e9, rel=0.02)
    assert fp32_8b == pytest.approx(2 * bf16_8b, rel=1e-6)
    assert bf16_70b == pytest.approx(141e9, rel=0.02)
    model = meta_model(config_70b)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(70.55e9, rel=1e-3)
    fp4 = estimate_memory(config_8b, torch.bfloat16, quantization="4bit").weights
    assert 5e9 < fp4 < 6.5e9  # linears in nf4, embeddings and head in bfloat16


def test_check_fits_refuses_70b_here_with_the_numbers() -> None:
    estimate = estimate_memory(tf.LlamaConfig(**LLAMA_70B), torch.bfloat16).weights
    with pytest.raises(ResourceLimitError) as info:
        check_fits(estimate, make_placement(dtype="bfloat16"), dtype=torch.bfloat16, what="model 'llama-70b'")
    message = info.value.message
    assert readable_size(estimate) in message and f"{estimate:,} bytes" in message
    assert "--device-map" in message and "cpu has" in message and "\n" not in message
    with pytest.raises(ResourceLimitError, match=r"--dtype bfloat16"):
        check_fits(2 * estimate, make_placement(), dtype=torch.float32)


def test_check_fits_budgets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    estimate = estimate_memory(tf.LlamaConfig(**LLAMA_8B), torch.bfloat16).weights
    monkeypatch.setattr(pl, "available_memory", lambda device: 40 * 10**9)
    check_fits(estimate, Placement(dtype="bfloat16"))  # 16 GB into 36 GB usable
    monkeypatch.setattr(pl, "available_memory", lambda device: 17 * 10**9)
    with pytest.raises(ResourceLimitError, match=r"cpu has 15.8 GiB free \(90% usable\)"):
        check_fits(estimate, Placement(dtype="bfloat16"))
    with pytest.raises(ResourceLimitError, match=r"max_memory \(cpu=10GiB\) allows 10 GiB"):
        check_fits(estimate, make_placement(device_map="auto", max_memory="cpu=10GiB"))
    check_fits(estimate, make_placement(device_map="auto", max_memory="cpu=20GiB"))
    monkeypatch.setattr(pl, "disk_free", lambda folder: 10**12)
    check_fits(estimate, make_placement(device_map="auto", max_memory="cpu=1GiB", offload_folder=str(tmp_path)))
    monkeypatch.setattr(pl, "available_memory", lambda device: None)
    check_fits(estimate, Placement())  # memory unknown: let the load try


def test_checkpoint_headers_cross_check(tiny_folder: Path, tmp_path: Path) -> None:
    config = tf.AutoConfig.from_pretrained(tiny_folder)
    assert estimate_memory(config, torch.float32).weights == TINY_PARAMS * 4 + 2 * 8 * 4  # + two inv_freq buffers
    assert checkpoint_bytes(tiny_folder, torch.float32) == TINY_PARAMS * 4
    assert checkpoint_bytes(tiny_folder, torch.bfloat16) == TINY_PARAMS * 2
    assert checkpoint_bytes(tmp_path, torch.float32) is None
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    index = {"metadata": {"total_size": 1000}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint_bytes(sharded, torch.bfloat16, torch.float32) == 500  # shards absent: the index total


def test_placement_import_is_cheap() -> None:
    code = "import sys, agent_tools.placement; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_tiny_folder_loads_in_bfloat16_cached_per_placement(tiny_folder: Path) -> None:
    bf16 = load_model(str(tiny_folder), Placement(dtype="bfloat16"))
    try:
        assert bf16.dtype == torch.bfloat16 and next(bf16.model.parameters()).dtype == torch.bfloat16
        assert bf16.device == torch.device("cpu") and bf16.placement.dtype == "bfloat16"
        assert bf16.estimated_bytes == TINY_PARAMS * 2 + 2 * 8 * 4
        fp32 = load_model(str(tiny_folder))
        assert fp32 is not bf16 and fp32.dtype == torch.float32 and fp32.estimated_bytes == TINY_PARAMS * 4 + 64
        assert load_model(str(tiny_folder), Placement(dtype="float32", device="cpu")) is fp32
        assert load_model(str(tiny_folder), make_placement(dtype="bfloat16", device="cpu")) is bf16
    finally:
        forget_model(str(tiny_folder))
    assert str(tiny_folder) not in loaded_models()


def test_registered_models_match_any_placement() -> None:
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY)).eval()
    registered = register_model("tiny-registered", model, tiny_tokenizer())
    try:
        assert load_model("tiny-registered", Placement(dtype="bfloat16")) is registered
        assert registered.dtype == torch.float32 and registered.estimated_bytes is None
    finally:
        forget_model("tiny-registered")
    assert "tiny-registered" not in loaded_models()


def test_disk_offload_loads_and_matches(tiny_folder: Path, tmp_path: Path) -> None:
    ids = torch.tensor([[0, 6, 8, 9, 10, 11, 12]])
    reference = load_model(str(tiny_folder))
    offload = make_placement(device_map="sequential", max_memory="cpu=200KB", offload_folder=str(tmp_path / "off"))
    try:
        offloaded = load_model(str(tiny_folder), offload)
        assert "disk" in offloaded.model.hf_device_map.values()
        assert offloaded.device == torch.device("cpu") and offloaded.dtype == torch.float32
        with torch.inference_mode():
            expected = reference.model(ids).logits
            got = offloaded.model(ids.to(offloaded.device)).logits
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    finally:
        forget_model(str(tiny_folder))


def test_refused_and_failed_loads_cache_nothing(
    tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ResourceLimitError, match=r"max_memory \(cpu=200KB\) allows 195 KiB"):
        load_model(str(tiny_folder), make_placement(device_map="auto", max_memory="cpu=200KB"))
    calls: list[str] = []
    monkeypatch.setattr(pl, "available_memory", lambda device: 1000)
    monkeypatch.setattr(tf.LlamaForCausalLM, "from_pretrained", lambda *a, **k: calls.append("read") or None)
    weights = readable_size(TINY_PARAMS * 4)
    with pytest.raises(ResourceLimitError, match=rf"model .*tiny-llama.* needs about .* \(weights {weights}, \+"):
        load_model(str(tiny_folder))
    assert calls == []  # refused before any weight was read
    no_tokenizer = tmp_path / "no-tokenizer"
    tf.LlamaForCausalLM(tf.LlamaConfig(**TINY)).save_pretrained(no_tokenizer)
    monkeypatch.undo()
    with pytest.raises(ModelNotFoundError, match="could not load model folder"):
        load_model(str(no_tokenizer))
    assert str(tiny_folder) not in loaded_models() and str(no_tokenizer) not in loaded_models()


def test_gguf_cache_folder_is_keyed_by_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTENTION_EXPLAINER_CACHE", str(tmp_path))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\1" * 4096)
    fp32, bf16 = _gguf_target(gguf, torch.float32), _gguf_target(gguf, torch.bfloat16)
    assert fp32.parent == tmp_path / "gguf" and fp32.name.startswith("m-") and len(fp32.name) == len("m-") + 24
    assert bf16.name == fp32.name + "-bfloat16"


@pytest.mark.slow
@pytest.mark.real_model
def test_gguf_converts_in_bfloat16_at_half_the_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTENTION_EXPLAINER_CACHE", str(tmp_path))
    path = resolve_reference("smollm2-135m-instruct").path
    assert path is not None
    loaded = load_model(str(path), Placement(dtype="bfloat16"))
    try:
        assert loaded.dtype == torch.bfloat16
        weights = _gguf_target(path, torch.bfloat16) / "model.safetensors"
        assert weights.is_file() and weights.stat().st_size == pytest.approx(loaded.estimated_bytes, rel=1e-3)
        assert loaded.estimated_bytes == pytest.approx(269.0e6, rel=0.01)  # 538 MB in float32
    finally:
        forget_model(str(path))


LLAMA_32_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072, dtype="bfloat16",
)  # fmt: skip


def test_pass_bytes_hand_computed() -> None:
    """hidden 8, 2 heads of 4, 1 KV head, MLP 16, 3 layers, vocab 10, 5 tokens, float32:
    per token (4·8 + (2 + 2·1)·4 + 3·16 + 2·3·1·4)·4 = 480 B, ×5 = 2400; logits 5·10·(4 + 4) = 400;
    one attention block 3·2·5·5·4 = 600 -> 3400."""
    config = tf.LlamaConfig(
        hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, intermediate_size=16,
        num_hidden_layers=3, vocab_size=10,
    )  # fmt: skip
    assert pl.pass_bytes(config, torch.float32, 5) == 3400


def test_estimate_counts_the_upcast_copy_and_the_pass(tmp_path: Path) -> None:
    """A bfloat16 checkpoint loaded in float32 holds the file's tensors while converting (half the float32 weights);
    in its own dtype the model's tensors are the mapped file's pages (no copy), unless the file is a pickle or the
    config does not say how it was saved. The peak is the weights plus the larger of the copy and one pass."""
    config = tf.LlamaConfig(**LLAMA_32_1B)
    upcast = pl.estimate_memory(config, torch.float32)
    own = pl.estimate_memory(config, torch.bfloat16)
    buffers = 1024  # the rotary inverse frequencies stay float32 in both
    assert abs(upcast.weights - 2 * own.weights) <= buffers and abs(upcast.load_copy - own.weights) <= buffers
    assert own.load_copy == 0 and own.peak == own.weights + own.working_set
    assert upcast.tokens == pl.CHECK_TOKENS and upcast.working_set == pl.pass_bytes(config, torch.float32, 2048)
    assert upcast.peak == upcast.weights + max(upcast.load_copy, upcast.working_set)
    unsaid = tf.LlamaConfig(**{k: v for k, v in LLAMA_32_1B.items() if k != "dtype"})
    unsaid.dtype = None
    assert pl.estimate_memory(unsaid, torch.bfloat16).load_copy == own.weights  # counted as a conversion
    (tmp_path / "pytorch_model.bin").write_bytes(b"")  # a pickle is read into memory, then copied
    assert pl.estimate_memory(config, torch.bfloat16, folder=tmp_path).load_copy == own.weights


def test_check_fits_counts_the_peak_not_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    config = tf.LlamaConfig(**LLAMA_32_1B)
    plan = pl.estimate_memory(config, torch.float32)
    free = int((plan.weights + plan.load_copy // 2) / pl.HEADROOM)  # the weights fit, the upcast peak does not
    monkeypatch.setattr(pl, "available_memory", lambda device: free)
    check_fits(plan.weights, Placement())  # weights alone (the old check) would pass
    with pytest.raises(ResourceLimitError, match="checkpoint mapped while loading") as info:
        check_fits(plan, Placement(), dtype=torch.float32)
    assert f"{plan.peak:,} bytes" in info.value.message and "add --dtype bfloat16" in info.value.message


def test_advice_names_the_missing_flag_and_offload_checks_the_disk(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plan = pl.estimate_memory(tf.LlamaConfig(**LLAMA_70B), torch.bfloat16)
    monkeypatch.setattr(pl, "available_memory", lambda device: 100 * 2**30)
    given = make_placement(dtype="bfloat16", device_map="auto", max_memory="cpu=60GiB")
    with pytest.raises(ResourceLimitError) as info:
        check_fits(plan, given, dtype=torch.bfloat16, what="model 'llama-70b'")
    message = info.value.message
    assert "add --offload-folder" in message and "--max-memory" not in message and "--device-map" not in message
    offloaded = make_placement(dtype="bfloat16", device_map="auto", max_memory="cpu=60GiB", offload_folder=tmp_path)
    monkeypatch.setattr(pl, "disk_free", lambda folder: 10 * 2**30)
    spill = plan.weights + plan.working_set - 60 * 2**30
    with pytest.raises(ResourceLimitError, match=rf"spills about {pl.readable_size(spill)} to the offload folder"):
        check_fits(plan, offloaded, dtype=torch.bfloat16)
    monkeypatch.setattr(pl, "disk_free", lambda folder: spill + 2**30)
    check_fits(plan, offloaded, dtype=torch.bfloat16)  # room on disk: the load may try


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "llama-70b"])
def test_describe_model_answers_from_a_config_only_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """A folder with only config.json is described from the meta device (no weight read, no load) with the memory
    the operator's placement would need; a 70B describes on a machine it would never fit."""
    from agent_tools.inspector import Inspector
    from agent_tools.tools import get_tool

    config = tf.LlamaConfig(**{**(LLAMA_32_1B if shape == "llama-3.2-1b" else LLAMA_70B), "dtype": "bfloat16"})
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path / shape)
    assert [p.name for p in (tmp_path / shape).iterdir()] == ["config.json"]
    monkeypatch.setattr(tf.LlamaForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights were read"))
    report = get_tool("describe_model")(Inspector(), {"model": str(tmp_path / shape)})
    assert not report.weights_loaded and report.device == "cpu" and report.dtype == "float32"
    assert (report.num_layers, report.num_heads, report.num_kv_heads) == (
        config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
    )  # fmt: skip
    expected = pl.estimate_memory(config, torch.float32)
    assert report.memory is not None and report.memory.peak_bytes == expected.peak
    assert report.memory.load_copy_bytes == expected.load_copy > 0  # a bfloat16 checkpoint upcast to float32
    assert str(tmp_path / shape) not in loaded_models()


def test_auto_dtype_on_the_cpu_follows_its_bfloat16_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on a CPU: bfloat16 with AMX or AVX-512 BF16, float32 without or where the operator switched it off
    ($ATTENTION_EXPLAINER_CPU_BF16=0, which the suite sets); the reason names what was found."""
    monkeypatch.delenv("ATTENTION_EXPLAINER_CPU_BF16")
    monkeypatch.setattr(pl, "cpu_bf16_flags", lambda: ("amx_bf16",))
    assert pl.resolve_dtype(Placement(device="cpu")) == torch.bfloat16
    assert pl.cache_key(Placement(device="cpu")).startswith("bfloat16@cpu")
    assert "bfloat16 hardware (amx_bf16)" in pl.dtype_reason(Placement(device="cpu"))
    monkeypatch.setenv("ATTENTION_EXPLAINER_CPU_BF16", "0")
    assert pl.resolve_dtype(Placement(device="cpu")) == torch.float32
    assert pl.dtype_reason(Placement(device="cpu")) == (
        "float32: auto on a CPU whose bfloat16 hardware (amx_bf16) is switched off (ATTENTION_EXPLAINER_CPU_BF16=0)"
    )
    monkeypatch.setattr(pl, "cpu_bf16_flags", lambda: ())
    assert pl.resolve_dtype(Placement(device="cpu")) == torch.float32
    assert "without bfloat16 hardware" in pl.dtype_reason(Placement(device="cpu"))
    assert pl.dtype_reason(Placement(dtype="float16", device="cpu")) == "float16: the operator's --dtype"


def test_cpu_bf16_flags_read_from_cpuinfo() -> None:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").is_file() else []
    assert set(pl.cpu_bf16_flags()) == {flag for flag in pl.CPU_BF16_FLAGS if flag in flags}


def test_query_chunk_rows_fit_the_block() -> None:
    """3 float32 (heads, rows, length) tensors per block: 64 MiB at 32 heads × 2,048 keys holds 85 rows of 786,432
    bytes (85.3); when every row fits the answer is None (one block); never fewer than one row."""
    per_row = 3 * 32 * 2048 * 4  # 786,432 bytes
    assert query_chunk_rows(32, 2048, 64 * 1024**2) == 64 * 1024**2 // per_row == 85
    assert query_chunk_rows(32, 2048, 2048 * per_row) is None  # the whole layer in one block
    assert query_chunk_rows(32, 87_000, 1024) == 1  # never zero rows
    assert query_chunk_rows(9, 100, 10 * 3 * 9 * 100 * 4) == 10


def test_attention_block_bytes_follow_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU gets its configured budget; CUDA a quarter of the free memory mem_get_info reports, at least that."""
    assert attention_block_bytes("cpu") == ATTENTION_BLOCK_BYTES
    with monkeypatch.context() as patched:
        patched.setattr(pl, "ATTENTION_BLOCK_BYTES", 1000)
        assert attention_block_bytes("cpu") == 1000
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    free = {"bytes": 40 * 1024**3}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 * 1024**3))
    assert attention_block_bytes("cuda:0") == 10 * 1024**3
    with monkeypatch.context() as patched:
        patched.setattr(pl, "DEVICE_FREE_SHARE", 0.5)
        assert attention_block_bytes("cuda:0") == 20 * 1024**3
    free["bytes"] = 100 * 1024**2  # nearly full: never below the CPU's block
    assert attention_block_bytes("cuda:0") == ATTENTION_BLOCK_BYTES
    # 40 GiB free at 32 heads × 87,000 keys: 321 rows per block (the CPU's 64 MiB gives 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 1024**3, 80 * 1024**3))
    assert query_chunk_rows(32, 87_000, attention_block_bytes("cuda:0")) == 321
    assert query_chunk_rows(32, 87_000, ATTENTION_BLOCK_BYTES) == 2
