"""inspect_projections: hand-computed metrics, per-family weight slices, the tool on tiny and real models."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf
from families import FAMILIES, build_family, tiny_tokenizer
from reference import ATOL, SAMPLE_TEXT

from agent_tools.analysis.metrics import js_divergence
from agent_tools.analysis.projections import (
    effective_rank,
    matrix_spectrum,
    no_projection_attention,
    principal_angles,
    product_spectrum,
    qk_identity_alignment,
    qk_symmetric_share,
    random_subspace_cos2,
    self_argmax_fraction,
    self_share,
)
from agent_tools.errors import InvalidInputError, UnsupportedModelError
from agent_tools.families import find_attention_modules
from agent_tools.head_inputs_pass import plan_head_inputs
from agent_tools.inspector import Inspector
from agent_tools.layout import SUPPORTED_PROJECTION_FAMILIES, apply_rotary, head_projections
from agent_tools.loading import register_model
from agent_tools.tools import get_tool
from agent_tools.tools.inspect_projections import ProjectionReport

TINY_TEXT = "the cat sat on the mat because it was tired . and the dog sat"


def causal_mask(length: int) -> torch.Tensor:
    """(T, T) additive causal mask as transformers builds it (0 / dtype-min)."""
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    return torch.zeros(length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)


# --- hand-computed metrics ---------------------------------------------------------------------------------
def test_effective_rank_of_known_matrices() -> None:
    # σ = (3, 1): p = (3/4, 1/4), H = −(¾ ln ¾ + ¼ ln ¼) = 0.562335, erank = e^H = 1.754765
    assert effective_rank(torch.tensor([3.0, 1.0])) == pytest.approx(1.754765, abs=1e-6)
    assert matrix_spectrum(torch.eye(4)).effective_rank == pytest.approx(4.0)
    rank_one = torch.outer(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, -1.0]))
    assert matrix_spectrum(rank_one).effective_rank == pytest.approx(1.0, abs=1e-6)
    spectrum = matrix_spectrum(torch.tensor([[3.0, 0.0], [0.0, 4.0]]))
    assert spectrum.singular_values.tolist() == pytest.approx([4.0, 3.0])
    assert (spectrum.spectral_norm, spectrum.frobenius_norm) == pytest.approx((4.0, 5.0))
    assert spectrum.stable_rank == pytest.approx(25 / 16)
    assert spectrum.effective_rank == pytest.approx(math.exp(-(4 / 7) * math.log(4 / 7) - (3 / 7) * math.log(3 / 7)))


def test_principal_angles_of_known_subspaces() -> None:
    e1, e2, e3 = torch.eye(3)
    angles = torch.rad2deg(principal_angles(torch.stack([e1, e2], 1), torch.stack([e1, e3], 1)))
    assert angles.tolist() == pytest.approx([0.0, 90.0], abs=1e-4)
    diagonal = torch.rad2deg(principal_angles(e1[:, None], (e1 + e2)[:, None]))
    assert diagonal.tolist() == pytest.approx([45.0], abs=1e-4)
    # Non-orthonormal bases of the same plane: both angles zero.
    same = principal_angles(torch.stack([2 * e1, e1 + e2], 1), torch.stack([e2, -e1], 1))
    assert same.tolist() == pytest.approx([0.0, 0.0], abs=1e-4)
    # A rank-deficient basis counts its rank only.
    assert principal_angles(torch.stack([e1, 2 * e1], 1), torch.stack([e1, e2], 1)).numel() == 1


def test_random_subspace_baseline() -> None:
    generator = torch.Generator().manual_seed(0)
    cos2 = [
        torch.cos(principal_angles(torch.randn(64, 8, generator=generator), torch.randn(64, 8, generator=generator)))
        .square()
        .mean()
        .item()
        for _ in range(30)
    ]
    assert sum(cos2) / len(cos2) == pytest.approx(random_subspace_cos2(8, 8, 64), abs=0.02)


def test_qk_circuit_measures() -> None:
    eye = torch.eye(3)
    assert qk_symmetric_share(eye, eye) == pytest.approx(1.0)
    assert qk_identity_alignment(eye, eye) == pytest.approx(1.0)
    rotation = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])  # W_Q W_Kᵀ antisymmetric
    assert qk_symmetric_share(rotation, torch.eye(2)) == pytest.approx(0.0)
    assert qk_identity_alignment(rotation, torch.eye(2)) == pytest.approx(0.0)
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(20, 4, generator=generator), torch.randn(20, 4, generator=generator)
    expected = torch.linalg.svdvals((a @ b.T).double())[:4]
    assert torch.allclose(product_spectrum(a, b).singular_values, expected, atol=1e-9)


def test_js_divergence_hand_values() -> None:
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.2, 0.8]])
    q = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.2, 0.8]])
    # (½,½) vs (1,0): M = (¾,¼); ½[½ln(⅔)+½ln2] + ½ln(4/3) = 0.215762
    assert js_divergence(p, q).tolist() == pytest.approx([math.log(2), 0.215762, 0.0], abs=1e-6)
    assert torch.allclose(js_divergence(p, q), js_divergence(q, p))


def test_no_projection_attention_on_three_tokens() -> None:
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.5, 0.5]])
    weights = no_projection_attention(x, 1.0, causal_mask(3))
    e = math.e
    # x·xᵀ = [[1, 0, .5], [0, 4, 1], [.5, 1, .5]]; causal rows: (1), (0, 4), (.5, 1, .5)
    expected = torch.tensor(
        [
            [1.0, 0.0, 0.0],
            [1 / (1 + e**4), e**4 / (1 + e**4), 0.0],
            [e**0.5 / (2 * e**0.5 + e), e / (2 * e**0.5 + e), e**0.5 / (2 * e**0.5 + e)],
        ]
    )
    assert torch.allclose(weights, expected, atol=1e-6)
    allowed = torch.ones(3, 3, dtype=torch.bool).tril()
    assert self_argmax_fraction(weights) == pytest.approx(2 / 3)  # rows 0, 1 on themselves, row 2 on token 1
    assert self_argmax_fraction(weights, allowed) == pytest.approx(1 / 2)  # row 0 has no choice: left out
    assert self_share(weights) == pytest.approx((1 + e**4 / (1 + e**4) + e**0.5 / (2 * e**0.5 + e)) / 3, abs=1e-6)
    # Same scale: halving the scale flattens the rows.
    half = no_projection_attention(x, 0.5, causal_mask(3))
    assert half[1, 1] < weights[1, 1]


# --- weights: per-family slices ----------------------------------------------------------------------------
def _output_projection(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    attention = find_attention_modules(model)[layer]
    for name in ("o_proj", "out_proj", "dense", "c_proj"):
        if hasattr(attention, name):
            return getattr(attention, name)
    return model.encoder.layer[layer].attention.output.dense  # BERT


@pytest.mark.parametrize("name", FAMILIES)
def test_head_slices_rebuild_the_output_projection(name: str) -> None:
    """Σ_h z_h W_O^h + b_O equals the family's own output projection of the concatenated heads."""
    model = build_family(name)
    layer = 1
    out = _output_projection(model, layer)
    heads = model.config.num_attention_heads
    slices = [head_projections(model, layer, h) for h in range(heads)]
    d_head = slices[0].d_head
    z = torch.randn(5, heads * d_head, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = out(z)
    bias = out.bias if getattr(out, "bias", None) is not None else 0.0
    got = sum(z[:, h * d_head : (h + 1) * d_head] @ slices[h].w_o for h in range(heads)) + bias
    assert torch.allclose(got, expected, atol=ATOL)
    assert slices[-1].kv_head == (heads - 1) // (heads // (getattr(model.config, "num_key_value_heads", None) or heads))


@pytest.mark.parametrize("name", FAMILIES)
def test_head_slices_reproduce_the_captured_attention(name: str, tiny_models, inspector: Inspector) -> None:
    """q, k (through scores), v and the map rebuilt from the slices equal what the model computed, per head."""
    loaded = tiny_models[name]
    encoded = inspector.encode(loaded, TINY_TEXT)
    for head in range(loaded.facts.num_heads):
        inputs = inspector.execute(plan_head_inputs(inspector, loaded, encoded, 1, [head]))
        assert inputs.errors["values"] <= ATOL, (name, head)
        assert inputs.errors["positional_scores"] <= ATOL, (name, head)
        assert inputs.errors["model_weights"] <= ATOL, (name, head)


def test_apply_rotary_matches_transformers() -> None:
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_rotary
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rotary

    generator = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 5, 8, generator=generator), torch.randn(1, 2, 5, 8, generator=generator)
    angles = torch.randn(1, 5, 4, generator=generator)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # (1, 5, 8)
    q_ref, k_ref = llama_rotary(q, k, cos, sin)
    assert torch.allclose(apply_rotary(q, cos[:, None], sin[:, None]), q_ref, atol=1e-6)
    assert torch.allclose(apply_rotary(k, cos[:, None], sin[:, None]), k_ref, atol=1e-6)
    partial_cos, partial_sin = cos[..., :2], sin[..., :2]  # 25% of 8 dims rotated, as in the tiny GPT-NeoX
    q_ref, _ = neox_rotary(q, k, partial_cos, partial_sin)
    assert torch.allclose(apply_rotary(q, partial_cos[:, None], partial_sin[:, None]), q_ref, atol=1e-6)


def test_unsupported_family_is_refused_by_name(inspector: Inspector) -> None:
    torch.manual_seed(0)
    config = tf.Qwen3Config(
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        head_dim=8,
        intermediate_size=64,
        vocab_size=96,
        max_position_embeddings=64,
    )
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    register_model("tiny-qwen3-projections", model, tiny_tokenizer())
    with pytest.raises(UnsupportedModelError, match=r"supported families: llama.*bert.*gpt2.*gpt_neox"):
        head_projections(model, 0, 0)
    for tool in ("inspect_projections", "reconstruct_attention"):
        with pytest.raises(UnsupportedModelError, match="qwen3"):
            get_tool(tool)(inspector, {"model": "tiny-qwen3-projections", "text": "the cat", "layer": 0, "head": 0})
    assert {"llama", "bert", "gpt2", "gpt_neox"} <= set(SUPPORTED_PROJECTION_FAMILIES)


# --- the tool ------------------------------------------------------------------------------------------------
def test_inspect_projections_gqa_tiny_llama(tiny_models, inspector: Inspector) -> None:
    report = get_tool("inspect_projections")(
        inspector, {"model": "tiny-llama", "text": TINY_TEXT, "layer": 1, "head": 3, "png": True}
    )
    assert isinstance(report, ProjectionReport)
    assert report.kv_head == 1 and report.heads_sharing_kv == [2, 3]
    assert [s.head for s in report.shared_kv_heads] == [2]
    assert report.model_weight_error <= ATOL
    names = [m.name for m in report.matrices]
    assert names[:4] == ["W_Q", "W_K", "W_V", "W_O"]
    model = tiny_models["llama"].model
    attention = find_attention_modules(model)[1]
    w_q = attention.q_proj.weight.detach()[3 * 8 : 4 * 8]  # (d_head, d_model) rows of head 3
    assert report.matrices[0].singular_values == pytest.approx(torch.linalg.svdvals(w_q).tolist(), abs=1e-3)
    for matrix in report.matrices:
        assert matrix.singular_values == sorted(matrix.singular_values, reverse=True)
        assert 1.0 <= matrix.effective_rank <= len(matrix.singular_values) + 1e-6
    angles = report.query_key_angles
    assert all(0.0 <= a <= 90.0 for a in angles.angles_deg) and len(angles.angles_deg) == 8
    assert angles.random_mean_cos2 == pytest.approx(8 / 32)
    cf = report.counterfactual
    assert 0.0 <= cf.mean_js_divergence <= math.log(2) and len(cf.rows) == len(report.tokens)
    assert cf.mask == "causal" and cf.png_path and cf.png_path.endswith(".png")
    assert "Roy & Vetterli" in report.effective_rank_definition
    assert "shares KV head 1 with heads 2" in report.summary


def test_counterfactual_numbers_match_a_direct_computation(tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models["bert"]
    report = get_tool("inspect_projections")(
        inspector, {"model": "tiny-bert", "text": TINY_TEXT, "layer": 0, "head": 1}
    )
    encoded = inspector.encode(loaded, TINY_TEXT)
    inputs = inspector.execute(plan_head_inputs(inspector, loaded, encoded, 0, [1]))
    direct = no_projection_attention(inputs.x, loaded.facts.scaling, None)
    assert report.counterfactual.self_argmax_fraction == pytest.approx(self_argmax_fraction(direct), abs=1e-4)
    js = js_divergence(inputs.weights[1], direct)
    assert report.counterfactual.mean_js_divergence == pytest.approx(float(js.mean()), abs=1e-4)
    assert report.counterfactual.mask.startswith("none") and report.shared_kv_heads == []
    assert "own K and V" in report.summary


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"layer": 2, "head": 0}, r"layer 2 out of range 0\.\.1"),
        ({"layer": 0, "head": 4}, r"head 4 out of range 0\.\.3"),
        ({"layer": -1, "head": 0}, r"layer -1 out of range 0\.\.1"),
        ({"layer": 0, "head": 0, "text": "   "}, "empty"),
    ],
)
def test_inspect_projections_bad_input(arguments, message, tiny_models, inspector: Inspector) -> None:
    with pytest.raises(InvalidInputError, match=message):
        get_tool("inspect_projections")(inspector, {"model": "tiny-llama", "text": TINY_TEXT, **arguments})


@pytest.mark.real_model
def test_inspect_projections_default_model(smol, inspector: Inspector) -> None:
    report = get_tool("inspect_projections")(inspector, {"text": SAMPLE_TEXT, "layer": 3, "head": 0})
    assert report.model_weight_error <= ATOL
    assert report.heads_sharing_kv == [0, 1, 2] and len(report.shared_kv_heads) == 2
    assert report.hidden_size == 576 and report.head_dim == 64
    assert len(report.query_key_angles.angles_deg) == 64
    assert report.query_key_angles.random_mean_cos2 == pytest.approx(64 / 576, abs=1e-4)
    # Raw normalised inputs resemble themselves most: without projections nearly every query reads itself.
    assert report.counterfactual.self_argmax_fraction > report.counterfactual.model_self_argmax_fraction


@pytest.mark.real_model
def test_inspect_projections_minilm(minilm, inspector: Inspector) -> None:
    report = get_tool("inspect_projections")(
        inspector, {"model": "minilm-l6", "text": SAMPLE_TEXT, "layer": 2, "head": 5}
    )
    assert report.model_weight_error <= ATOL
    assert report.family == "bert" and report.shared_kv_heads == []
    assert report.matrices[0].bias_norm is not None  # BERT has query/key/value biases
    assert report.counterfactual.mask.startswith("none")
