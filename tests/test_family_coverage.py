"""The coverage list (tests/families.py COVERAGE): every exact family's capture equals its own eager attention on
every stack, every refusal says what is true, and the README's coverage table is the list's own table."""

from __future__ import annotations

import math
import runpy
from pathlib import Path
from typing import Any

import pytest
import torch
from families import ATTENTIONS, COVERAGE, COVERAGE_BY_NAME, SEQ2SEQ, Coverage, build_family, coverage_table
from reference import ATOL, KeepAll, eager_reference, output_tensor

from agent_tools.capture import LayerAttention, capture_attention
from agent_tools.errors import InvalidInputError, UnsupportedModelError
from agent_tools.families import attention_stacks, find_attention_modules, read_facts

ROOT = Path(__file__).resolve().parents[1]
CAPTURED = [entry for entry in COVERAGE if entry.captured]
REFUSED = [entry for entry in COVERAGE if entry.refusal]
START, END = "<!-- family-coverage:start -->", "<!-- family-coverage:end -->"


def _rebuilt(layer: LayerAttention) -> torch.Tensor:
    """softmax(q·kᵀ·scale (soft-capped) + bias + mask [, sink column]) from the captured tensors alone."""
    key = layer.head_key(layer.key)[:, :, : layer.key_width]
    scores = layer.query @ key.transpose(-1, -2) * layer.scaling
    if layer.softcap:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if layer.bias is not None:
        scores = scores + layer.bias
    if layer.mask is not None:
        scores = scores + layer.mask
    if layer.sink_logits is None:
        return torch.softmax(scores.float(), dim=-1)
    column = layer.sink_logits.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1).float(), dim=-1)[..., :-1]


def _peaked_share(maps: tuple[torch.Tensor, ...]) -> float:
    """The share of rows (reading at least 3 keys, so not trivially peaked) whose largest weight is > 0.5."""
    rows = torch.cat([weights.flatten(0, 2) for weights in maps])  # (rows, keys)
    real = (rows > 0).sum(-1) >= 3
    return float((rows[real].amax(-1) > 0.5).float().mean())


class KeepChecked(KeepAll):
    """Keeps every chunk and checks each one against the rebuild from its own q, k, bias and mask."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[LayerAttention] = []

    def on_layer(self, layer: LayerAttention) -> None:
        super().on_layer(layer)
        self.seen.append(layer)
        assert (_rebuilt(layer) - layer.weights).abs().max().item() <= ATOL
        total = layer.weights.sum(-1) + layer.sink_share()
        assert (total - 1).abs().max().item() <= 1e-5  # real keys and the sink column share each row


@pytest.fixture(scope="module", params=CAPTURED, ids=lambda entry: entry.name)
def built(request: pytest.FixtureRequest) -> tuple[Coverage, torch.nn.Module, dict[str, torch.Tensor], Any]:
    entry: Coverage = request.param
    model = entry.build()
    inputs = entry.inputs()
    reference = entry.reference(model, **inputs) if entry.reference else eager_reference(model, **inputs)
    return entry, model, inputs, reference


def test_capture_equals_the_familys_own_attention_on_every_stack(built: tuple) -> None:
    entry, model, inputs, reference = built
    facts = read_facts(model)
    assert facts.family == entry.family
    assert facts.stack_names == entry.stacks
    assert facts.is_encoder_decoder == (entry.stacks == SEQ2SEQ)
    terms: set[str] = set()
    for stack in entry.stacks:
        expected = getattr(reference, ATTENTIONS[stack])
        stack_facts = facts.stack(stack)
        assert len(expected) == stack_facts.num_layers == len(find_attention_modules(model, stack))
        share = _peaked_share(expected)  # peaked maps, or a comparison at 1e-5 could not see an error
        assert share >= 0.2, f"{entry.name} {stack}: only {share:.0%} of rows have a weight > 0.5"
        keep = KeepChecked()
        with torch.inference_mode(), capture_attention(model, [keep], stack=stack, query_chunk=4):
            output = model(**inputs)
        assert sorted(keep.rows) == list(range(stack_facts.num_layers))
        for index, weights in enumerate(expected):
            got = keep.weights(index)
            assert got.shape == weights.shape
            error = (got - weights).abs().max().item()
            assert error <= ATOL, f"{entry.name} {stack} layer {index}: {error:.2e}"
        assert (output_tensor(output) - output_tensor(reference)).abs().max().item() <= ATOL
        for layer in keep.seen:
            assert layer.stack == stack
            assert set(layer.terms) <= set(stack_facts.score_terms)
            assert layer.scaling == pytest.approx(1.0 if facts.query_prescaled else stack_facts.scaling)
            terms.update(layer.terms)
        assert set(stack_facts.score_terms) <= terms | {"sink logit"} or not stack_facts.score_terms
    assert tuple(sorted(terms)) == tuple(sorted(entry.terms))
    assert tuple(sorted({t for s in facts.stacks for t in s.score_terms})) == tuple(sorted(entry.terms))


HALF_PRECISION = ("distilbert", "modernbert", "t5", "umt5", "bart", "gpt_oss", "deepseek_v3", "whisper")


@pytest.mark.parametrize("name", HALF_PRECISION)
def test_capture_is_bit_identical_in_bfloat16(name: str) -> None:
    """In bfloat16 too the captured weights are the family's own eager ones bit for bit, on every stack."""
    entry = COVERAGE_BY_NAME[name]
    model = entry.build().to(torch.bfloat16)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in entry.inputs().items()}
    reference = eager_reference(model, **inputs)
    for stack in entry.stacks:
        keep = KeepAll()
        with torch.inference_mode(), capture_attention(model, [keep], stack=stack):
            model(**inputs)
        for index, expected in enumerate(getattr(reference, ATTENTIONS[stack])):
            got = keep.weights(index)
            assert got.dtype == expected.dtype == torch.bfloat16
            assert torch.equal(got, expected), f"{name} {stack} layer {index}"


@pytest.mark.parametrize("entry", REFUSED, ids=lambda entry: entry.name)
def test_refusals_say_what_is_true(entry: Coverage) -> None:
    model = entry.build()
    with pytest.raises(UnsupportedModelError, match=entry.refusal):
        if entry.refuse is not None:
            entry.refuse(model)
        else:
            with torch.inference_mode(), capture_attention(model, [KeepAll()]):
                model(**entry.inputs())


def test_readme_table_is_the_coverage_list() -> None:
    readme = (ROOT / "README.md").read_text()
    assert START in readme and END in readme, "README has no family-coverage section"
    section = readme.split(START, 1)[1].split(END, 1)[0]
    assert section.strip() == coverage_table().strip(), "README table drifted: run scripts/family_coverage.py --write"


def test_script_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    script = runpy.run_path(str(ROOT / "scripts" / "family_coverage.py"))
    assert script["main"]([]) == 0
    assert capsys.readouterr().out.strip() == coverage_table().strip()
    assert len(coverage_table().strip().splitlines()) == len(COVERAGE) + 2


def test_cross_attention_reads_the_encoder_with_its_padding_mask_only() -> None:
    entry = COVERAGE_BY_NAME["bart"]
    model, inputs = entry.build(), entry.inputs()
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(model, [keep], stack="cross"):
        model(**inputs)
    layer = keep.layers[0]
    decoder_rows, encoder_keys = inputs["decoder_input_ids"].shape[1], inputs["input_ids"].shape[1]
    assert layer.query.shape[2] == layer.query_length == decoder_rows and layer.key_length == encoder_keys
    allowed = layer.allowed()
    assert bool(allowed[0].all()) and bool(allowed[1, 0, :, :-3].all()) and not bool(allowed[1, 0, :, -3:].any())


def test_t5_bias_is_the_models_own_relative_position_bias() -> None:
    model, inputs = COVERAGE_BY_NAME["t5"].build(), COVERAGE_BY_NAME["t5"].inputs()
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(model, [keep], stack="encoder"):
        model(**inputs)
    length = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        own = model.encoder.block[0].layer[0].SelfAttention.compute_bias(length, length)  # (1, H, T, T)
    for layer in keep.layers.values():  # every layer adds layer 0's table
        assert layer.terms == ("relative position bias",)
        assert layer.bias is not None and torch.equal(layer.bias.expand_as(own), own)


def test_gpt_oss_rows_that_read_nothing_give_everything_to_the_sink() -> None:
    model, inputs = COVERAGE_BY_NAME["gpt_oss"].build(), COVERAGE_BY_NAME["gpt_oss"].inputs()
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(model, [keep]):
        model(**inputs)
    layer = keep.layers[0]
    assert layer.terms == ("sink logit",) and layer.sink_logits is not None
    share = layer.sink_share()  # (B, H, q)
    assert (share[1, :, :3] - 1).abs().max().item() <= 1e-6  # left padding: the first 3 rows may read no key
    assert float(share[0].min()) > 0.0
    # the share is the sink column of softmax([logits, s_h]): 1 / (1 + Σ_j exp(z_j − s_h)), by hand
    assert layer.logits is None  # the buffer is released after on_layer; recompute from scores and mask
    logits = layer.scores + layer.mask
    by_hand = 1 / (1 + torch.exp(logits - layer.sink_logits.view(1, -1, 1, 1)).sum(-1))
    assert (by_hand - share).abs().max().item() <= 1e-6


def test_mla_facts_have_the_qk_width_and_the_real_scale() -> None:
    model = COVERAGE_BY_NAME["deepseek_v3"].build()
    facts = read_facts(model)
    module = find_attention_modules(model)[0]
    assert (facts.head_dim, facts.qk_dim) == (12, 24)  # v_head_dim; qk_nope + qk_rope
    mscale = 0.1 * 1.0 * math.log(40.0) + 1.0  # yarn_get_mscale(factor 40, mscale_all_dim 1)
    assert facts.scaling == pytest.approx(24**-0.5 * mscale**2) == module.scaling
    assert facts.scaling * math.sqrt(facts.qk_dim) == pytest.approx(1.874, abs=5e-4)  # explain_scaling's ratio


def test_distilbert_layers_are_numbered_in_module_order() -> None:
    model = COVERAGE_BY_NAME["distilbert"].build()
    modules = find_attention_modules(model)
    assert modules == [block.attention for block in model.transformer.layer]
    assert not hasattr(modules[0], "layer_idx")


def test_a_stack_the_model_lacks_is_an_error_naming_the_valid_ones() -> None:
    model = build_family("llama")
    stack = capture_attention(model, [KeepAll()], stack="cross")
    with pytest.raises(InvalidInputError, match="no 'cross' attention stack; valid: 'self'"), stack:
        pass
    with pytest.raises(InvalidInputError, match="valid: 'self'"):
        read_facts(model).stack("decoder")
    seq2seq = COVERAGE_BY_NAME["bart"].build()
    assert read_facts(seq2seq).stack().name == "encoder"  # the default stack of an encoder–decoder
    with pytest.raises(InvalidInputError, match="valid: 'encoder', 'decoder', 'cross'"):
        find_attention_modules(seq2seq, "self")


def test_encoder_and_decoder_depths_differ_per_stack() -> None:
    facts = read_facts(COVERAGE_BY_NAME["bart"].build())  # 2 encoder layers × 4 heads, 3 decoder layers × 2 heads
    assert [(s.name, s.num_layers, s.num_heads, s.head_dim, s.is_causal) for s in facts.stacks] == [
        ("encoder", 2, 4, 8, False),
        ("decoder", 3, 2, 16, True),
        ("cross", 3, 2, 16, False),
    ]
    assert (facts.num_layers, facts.num_heads) == (2, 4)


def test_layer_indices_with_gaps_are_refused() -> None:
    model = build_family("llama")
    model.model.layers[1].self_attn.layer_idx = 2  # as in a hybrid model whose layer 1 has no attention
    with pytest.raises(UnsupportedModelError, match=r"do not number 0\.\.1"):
        attention_stacks(model)


def test_adapter_layers_not_asked_for_run_through_the_adapter_too() -> None:
    """Falcon-ALiBi's own forward under a non-sdpa implementation adds ALiBi twice; capturing only layer 1 must
    still run layer 0 as the model does, so layer 1's map equals the one from capturing every layer."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.FalconConfig(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=32, vocab_size=96, alibi=True,
        new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True,
    )  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.arange(6, 17)[None]
    whole, one = KeepAll(), KeepAll()
    with torch.inference_mode():
        own = model(input_ids=ids).logits  # the model's default (sdpa) path: ALiBi once
        with capture_attention(model, [whole]):
            all_layers = model(input_ids=ids).logits
        with capture_attention(model, [one], layers=[1]):
            layer_one = model(input_ids=ids).logits
    assert list(one.layers) == [1] and one.layers[1].terms == ("ALiBi",)
    assert (one.weights(1) - whole.weights(1)).abs().max().item() <= ATOL
    assert (layer_one - own).abs().max().item() <= ATOL and (all_layers - own).abs().max().item() <= ATOL
