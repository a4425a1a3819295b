"""Capture is exact: captured weights equal the model's own eager output_attentions, for every family."""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, build_family
from reference import ATOL, KeepAll, eager_reference, output_tensor, rebuild

from agent_tools.capture import CAPTURE_IMPLEMENTATION, LayerAttention, capture_attention, capture_attention_forward
from agent_tools.errors import UnsupportedModelError
from agent_tools.families import find_attention_modules, read_facts


def _inputs(name: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(6, 90, (2, 11), generator=generator)
    mask = torch.ones_like(ids)
    if name == "bert":
        mask[1, -3:] = 0  # right padding for the encoder
    else:
        mask[1, :3] = 0  # left padding for decoders
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name", FAMILIES)
def test_capture_equals_eager_output_attentions(name: str) -> None:
    model = build_family(name)
    inputs = _inputs(name)
    reference = eager_reference(model, **inputs)
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(model, [keep]):
        captured = model(**inputs)
    assert len(keep.layers) == len(reference.attentions) == model.config.num_hidden_layers
    for index, expected in enumerate(reference.attentions):
        got = keep.weights(index)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= ATOL, f"{name} layer {index}"
        assert (rebuild(keep.layers[index]) - got).abs().max().item() <= ATOL
    assert (output_tensor(captured) - output_tensor(reference)).abs().max().item() <= ATOL


@pytest.mark.parametrize("name", FAMILIES)
def test_query_chunks_give_the_same_rows_and_output(name: str) -> None:
    model = build_family(name)
    inputs = _inputs(name)
    whole, chunked = KeepAll(), KeepAll()
    with torch.inference_mode():
        with capture_attention(model, [whole]):
            out_whole = output_tensor(model(**inputs))
        with capture_attention(model, [chunked], query_chunk=4):
            out_chunked = output_tensor(model(**inputs))
    assert len(chunked.rows[0]) == 3  # 11 rows in chunks of 4
    for layer in whole.rows:
        assert torch.allclose(whole.weights(layer), chunked.weights(layer), atol=ATOL)
    assert torch.allclose(out_whole, out_chunked, atol=ATOL)


class KeepPrefix(KeepAll):
    """Accepts key prefixes: records each chunk's key width and pads its rows back to every key."""

    accepts_key_prefix = True

    def __init__(self) -> None:
        super().__init__()
        self.widths: list[int] = []

    def on_layer(self, layer: LayerAttention) -> None:
        self.widths.append(layer.key_width)
        assert layer.mask is None or layer.mask.shape[-1] == layer.key_width
        assert layer.scores.shape[-1] == layer.key_width
        assert layer.output is not None and torch.allclose(
            layer.output, layer.weights @ layer.head_key(layer.value)[:, :, : layer.key_width], atol=ATOL
        )
        padded = torch.zeros(*layer.weights.shape[:-1], layer.key_length)
        padded[..., : layer.key_width] = layer.weights
        self.rows.setdefault(layer.layer, []).append(padded)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("padded", [False, True])
def test_key_prefix_skips_only_columns_no_row_may_read(name: str, padded: bool) -> None:
    model = build_family(name)
    inputs = _inputs(name) if padded else {"input_ids": torch.arange(6, 17)[None]}
    whole, prefix = KeepAll(), KeepPrefix()
    with torch.inference_mode():
        with capture_attention(model, [whole]):
            out_whole = output_tensor(model(**inputs))
        with capture_attention(model, [prefix], query_chunk=4):
            out_prefix = output_tensor(model(**inputs))
    for layer in whole.rows:
        assert (whole.weights(layer) - prefix.weights(layer)).abs().max().item() <= ATOL, f"{name} layer {layer}"
    assert (out_whole - out_prefix).abs().max().item() <= ATOL
    causal = read_facts(model).is_causal
    first_chunk_widths = set(prefix.widths[::3])
    if causal and not padded:
        assert first_chunk_widths == {4}  # rows 0..3 of a causal map read keys 0..3 only
    if not causal:
        assert set(prefix.widths) == {11}  # an encoder's rows read every key
    if padded:  # left padding: the padded sequence's first rows read nothing, so those chunks keep every key
        assert (11 in first_chunk_widths) or not causal or name == "bert"


def test_gqa_is_recorded_and_shared_heads_read_the_same_keys() -> None:
    model = build_family("llama")
    facts = read_facts(model)
    assert (facts.num_heads, facts.num_kv_heads, facts.kv_groups) == (4, 2, 2)
    assert facts.heads_sharing_kv(1) == [2, 3] and facts.kv_head_of(3) == 1
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(model, [keep]):
        model(input_ids=torch.arange(6, 14)[None])
    layer = keep.layers[0]
    assert layer.kv_groups == 2 and layer.key.shape[1] == 2 and layer.query.shape[1] == 4
    assert torch.equal(layer.head_key(layer.key)[:, 2], layer.key[:, 1])


def test_mistral_sliding_window_mask_is_captured() -> None:
    model = build_family("mistral")  # sliding_window = 4
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(model, [keep]):
        model(input_ids=torch.arange(6, 16)[None])
    allowed = keep.layers[0].allowed()[0, 0]
    assert allowed[9].nonzero().flatten().tolist() == [6, 7, 8, 9]
    assert keep.weights(0)[0, :, 9, :6].abs().max().item() == 0.0


def test_gemma2_softcap_and_query_scale() -> None:
    model = build_family("gemma2")
    facts = read_facts(model)
    assert facts.softcap == 2.0 and facts.scaling == pytest.approx(16**-0.5)
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(model, [keep]):
        model(input_ids=torch.arange(6, 16)[None])
    assert keep.layers[0].scores.abs().max().item() <= 2.0


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma2", "bert"])
def test_padded_batch_equals_each_sequence_alone(name: str) -> None:
    model = build_family(name)
    a = torch.tensor([[7, 8, 9, 10, 11, 12]])
    b = torch.tensor([[20, 21, 22]])
    if name == "bert":  # encoders pad on the right
        batch, mask, real = (
            torch.tensor([[7, 8, 9, 10, 11, 12], [20, 21, 22, 3, 3, 3]]),
            torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]]),
            slice(0, 3),
        )
    else:  # decoders pad on the left
        batch, mask, real = (
            torch.tensor([[7, 8, 9, 10, 11, 12], [3, 3, 3, 20, 21, 22]]),
            torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]]),
            slice(3, 6),
        )
    extra = {} if name == "bert" else {"position_ids": (mask.cumsum(-1) - 1).clamp_min(0)}
    both, alone_a, alone_b = KeepAll(), KeepAll(), KeepAll()
    with torch.inference_mode():
        with capture_attention(model, [both]):
            out = output_tensor(model(input_ids=batch, attention_mask=mask, **extra))
        with capture_attention(model, [alone_a]):
            out_a = output_tensor(model(input_ids=a))
        with capture_attention(model, [alone_b]):
            out_b = output_tensor(model(input_ids=b))
    for layer in both.rows:
        assert torch.allclose(both.weights(layer)[0], alone_a.weights(layer)[0], atol=ATOL)
        assert torch.allclose(both.weights(layer)[1][:, real, real], alone_b.weights(layer)[0], atol=ATOL)
    assert torch.allclose(out[0], out_a[0], atol=ATOL)
    assert torch.allclose(out[1, real], out_b[0], atol=ATOL)


def test_implementation_and_hooks_restored_when_a_consumer_raises() -> None:
    model = build_family("llama")
    before = model.config._attn_implementation

    class Boom:
        accepts_key_prefix = False

        def on_layer(self, layer: LayerAttention) -> None:
            raise RuntimeError("consumer failed")

    with pytest.raises(RuntimeError, match="consumer failed"), capture_attention(model, [Boom()], record_inputs=True):
        model(input_ids=torch.arange(6, 10)[None])
    assert model.config._attn_implementation == before != CAPTURE_IMPLEMENTATION
    for module in find_attention_modules(model):
        assert not module._forward_pre_hooks


def test_layers_not_asked_for_are_not_captured() -> None:
    model = build_family("qwen2")
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(model, [keep], layers=[1]):
        model(input_ids=torch.arange(6, 12)[None])
    assert list(keep.layers) == [1]


def test_record_inputs_gives_the_attention_input() -> None:
    model = build_family("llama")
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(model, [keep], record_inputs=True):
        model(input_ids=torch.arange(6, 12)[None])
    layer = keep.layers[0]
    ids = torch.arange(6, 12)[None]
    with torch.inference_mode():
        embedded = model.model.embed_tokens(ids)  # (1, 6, 32)
        expected = model.model.layers[0].input_layernorm(embedded)  # what enters layer 0's attention
        cos, sin = model.model.rotary_emb(embedded, torch.arange(6)[None])
    assert layer.layer_input is not None and torch.equal(layer.layer_input, expected)
    assert layer.position_embeddings is not None
    assert torch.equal(layer.position_embeddings[0], cos) and torch.equal(layer.position_embeddings[1], sin)


def test_family_outside_the_interface_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="unsupported family"):
        find_attention_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_unreproduced_attention_features_are_refused() -> None:
    model = build_family("llama")
    module = find_attention_modules(model)[0]
    q = torch.zeros(1, 4, 2, 8)
    kv = torch.zeros(1, 2, 2, 8)
    with pytest.raises(UnsupportedModelError, match="'alibi'"):
        capture_attention_forward(module, q, kv, kv, None, scaling=0.1, alibi=torch.zeros(1, 4, 1, 2))
    with pytest.raises(UnsupportedModelError, match=r"one\s+learned logit per head \(4,\)"):
        capture_attention_forward(module, q, kv, kv, None, scaling=0.1, s_aux=torch.zeros(1, 4, 2, 1))
    with pytest.raises(UnsupportedModelError, match="not \\(B, H, q, Tk\\)"):
        capture_attention_forward(module, q, kv, kv, None, scaling=0.1, position_bias=torch.ones(4, 2, 2))


def test_uncaptured_bias_and_sinks_are_eager_and_exact() -> None:
    """Outside a capture the function adds the bias and the sink column exactly as the hand formula does."""
    model = build_family("llama")
    module = find_attention_modules(model)[0]
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 5, 8, generator=generator) for _ in range(3))
    bias = torch.randn(1, 4, 5, 5, generator=generator)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    output, weights = capture_attention_forward(module, q, k, v, None, scaling=0.3, position_bias=bias, s_aux=sinks)
    logits = torch.cat([q @ k.transpose(-1, -2) * 0.3 + bias, sinks.view(1, 4, 1, 1).expand(1, 4, 5, 1)], dim=-1)
    expected = torch.softmax(logits, dim=-1)[..., :-1]
    assert weights is not None and (weights - expected).abs().max().item() <= 1e-6
    assert (output - (expected @ v).transpose(1, 2)).abs().max().item() <= 1e-6


def _deep_llama(dtype: torch.dtype) -> torch.nn.Module:
    """A 16-layer Llama at small width, q/k scaled so maps are peaked: deep and sharp enough that a per-layer
    difference between sdpa and eager (~1e-7 in float32) compounds past 1e-5 by layer 14 (1.8e-4 when the layers
    before it ran sdpa)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=16, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.q_proj.weight.mul_(12.0)
            block.self_attn.k_proj.weight.mul_(12.0)
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers", [[14], [1, 14], [15]])
def test_any_layer_subset_gives_the_eager_maps_of_a_deep_model(dtype: torch.dtype, layers: list[int]) -> None:
    """Every layer before the last captured one runs the eager math, so a late layer captured alone equals the
    model's own eager attention (to 1e-5 in float32, bit for bit in bfloat16)."""
    model = _deep_llama(dtype)
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(2))
    reference = eager_reference(model, input_ids=ids)
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(model, [keep], layers=layers, query_chunk=16):
        model(input_ids=ids)
    assert sorted(keep.layers) == layers
    for layer in layers:
        got, expected = keep.weights(layer), reference.attentions[layer]
        if dtype == torch.float32:
            assert (got - expected).abs().max().item() <= ATOL, layer
        else:
            assert torch.equal(got, expected), layer


class _HostSyncs:
    """Counts tensor-to-Python conversions (each one waits for the device): item, tolist, bool, int, float."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(tensor: torch.Tensor, *args: object, _original=original, **kwargs: object) -> object:
                self.count += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


class _PrefixNoop:
    accepts_key_prefix = True

    def on_layer(self, layer: LayerAttention) -> None:
        layer.row_entropy()  # a shared per-row measure, kept on the device


def test_host_synchronisations_are_per_layer_not_per_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A causal capture in 4-row chunks with key prefixes: the key width of every chunk is decided with one host
    copy per layer, so 10 chunks per layer cost what 1 does."""
    model = build_family("llama")
    ids = torch.arange(6, 46)[None]  # 40 tokens
    counts = {}
    for chunk in (40, 4):
        syncs = _HostSyncs(monkeypatch)
        with torch.inference_mode(), capture_attention(model, [_PrefixNoop()], query_chunk=chunk):
            model(input_ids=ids)
        counts[chunk] = syncs.count
        monkeypatch.undo()
    layers = model.config.num_hidden_layers
    assert counts[4] <= counts[40] + layers, counts  # at most one more copy per layer, whatever the chunk count
    assert counts[4] <= 2 * layers, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_which_uncaptured_layers_run_sdpa(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pins capture.SDPA_AFTER_DTYPES: no layer before the last captured one runs sdpa (its rounding would reach
    the captured map); the layers after it do in float32 (output within 2e-5 of the eager pass's) and not in
    bfloat16, where the output stays the eager pass's bit for bit (sdpa there moved it 0.21 and changed top-1
    tokens)."""
    import agent_tools.capture as capture

    model = _deep_llama(dtype)
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(2))
    reference = eager_reference(model, input_ids=ids)
    ran_sdpa: list[int] = []
    original = capture.sdpa_attention_forward

    def counted(module: torch.nn.Module, *args: object, **kwargs: object) -> object:
        ran_sdpa.append(module.layer_idx)
        return original(module, *args, **kwargs)

    monkeypatch.setattr(capture, "sdpa_attention_forward", counted)
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(model, [keep], layers=[8], query_chunk=16):
        logits = model(input_ids=ids).logits
    if dtype == torch.float32:
        assert ran_sdpa == list(range(9, 16))
        assert (keep.weights(8) - reference.attentions[8]).abs().max().item() <= ATOL
        assert (logits - reference.logits).abs().max().item() <= 2e-5
    else:
        assert ran_sdpa == []
        assert torch.equal(keep.weights(8), reference.attentions[8])
        assert torch.equal(logits, reference.logits)
