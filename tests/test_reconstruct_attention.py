"""reconstruct_attention: stages hand-computed on three tokens; stage 5 equals the model's map for every family."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from families import FAMILIES, build_family
from reference import ATOL, SAMPLE_TEXT, eager_reference

from agent_tools.analysis.reconstruct import (
    RECONSTRUCTION_STAGES,
    positional_scores,
    reconstruction_stages,
    stage_measures,
)
from agent_tools.consumers.head_inputs import reconstruct
from agent_tools.errors import InvalidInputError
from agent_tools.head_inputs_pass import plan_head_inputs
from agent_tools.inspector import Inspector
from agent_tools.tools import get_tool
from agent_tools.tools.reconstruct_attention import AttentionReconstruction

TINY_TEXT = "the cat sat on the mat because it was tired . and the dog sat"
NEG = torch.finfo(torch.float32).min


def causal_mask(length: int) -> torch.Tensor:
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    return torch.zeros(length, length).masked_fill(~allowed, NEG)


def _three_token_stages(**options):
    """x = e1, e2, e1+e2 with W_Q = W_K = I, scale ½, RoPE rotating token m by m·90°."""
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    angles = torch.tensor([0.0, math.pi / 2, math.pi])[:, None]  # (T, 1)
    cos, sin = angles.cos().expand(3, 2), angles.sin().expand(3, 2)  # (T, d_rot=2)
    return reconstruction_stages(
        x, w_q=torch.eye(2), w_k=torch.eye(2), scaling=0.5, rotary=(cos, sin), mask=causal_mask(3), **options
    )


def test_stages_by_hand() -> None:
    stages = _three_token_stages()
    assert [s.stage for s in stages] == list(RECONSTRUCTION_STAGES)
    raw = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 1.0, 2.0]])
    assert torch.allclose(stages[0].scores, raw)
    assert torch.allclose(stages[1].scores, raw / math.sqrt(2))  # d_k = 2 (W_Q's columns)
    assert torch.allclose(stages[2].scores, raw * 0.5)  # identity projections, the model's scale ½
    # RoPE: q_0 = (1, 0), q_1 = R(90°)(0, 1) = (−1, 0), q_2 = R(180°)(1, 1) = (−1, −1)
    rotated = torch.tensor([[1.0, -1.0, -1.0], [-1.0, 1.0, 1.0], [-1.0, 1.0, 2.0]])
    assert torch.allclose(stages[3].scores, rotated * 0.5, atol=1e-6)
    e = math.e
    expected = torch.tensor(
        [
            [1.0, 0.0, 0.0],
            [1 / (1 + e), e / (1 + e), 0.0],
            [e**-0.5 / (e**-0.5 + e**0.5 + e), e**0.5 / (e**-0.5 + e**0.5 + e), e / (e**-0.5 + e**0.5 + e)],
        ]
    )
    assert torch.allclose(stages[4].weights, expected, atol=1e-6)
    # Stages 1–4 are unmasked by default: row 0 of the raw map reads keys 0 and 2 equally.
    assert stages[0].weights[0, 0] == pytest.approx(stages[0].weights[0, 2].item())


def test_stage_measures_by_hand() -> None:
    stages = _three_token_stages()
    final = stage_measures(stages[4])
    e = math.e
    z = e**-0.5 + e**0.5 + e
    row2 = [e**-0.5 / z, e**0.5 / z, e / z]
    entropy_row1 = -(1 / (1 + e)) * math.log(1 / (1 + e)) - (e / (1 + e)) * math.log(e / (1 + e))
    entropy_row2 = -sum(p * math.log(p) for p in row2)
    assert final.mean_entropy == pytest.approx((0 + entropy_row1 + entropy_row2) / 3, abs=1e-6)
    assert final.mean_normalised_entropy == pytest.approx(
        (0 + entropy_row1 / math.log(2) + entropy_row2 / math.log(3)) / 3
    )
    assert final.self_share == pytest.approx((1 + e / (1 + e) + e / z) / 3, abs=1e-6)
    assert final.mean_max_weight == pytest.approx(final.self_share, abs=1e-6)  # every row's max is itself
    assert final.top_key.tolist() == [0, 1, 2]
    # Logit spread over visible keys: row 0 one key (0), row 1 (−½, ½) → ½, row 2 (−½, ½, 1) → sqrt(7/18)
    assert final.logit_std == pytest.approx((0 + 0.5 + math.sqrt(7 / 18)) / 3, abs=1e-6)
    raw = stage_measures(stages[0])  # unmasked (1, 0, 1): population std sqrt(2/9)
    assert raw.logit_std == pytest.approx((math.sqrt(2 / 9) * 2 + math.sqrt(2 / 9)) / 3, abs=1e-6)


def test_softcap_and_mask_every_stage() -> None:
    capped = _three_token_stages(softcap=0.25)
    scores = capped[3].scores
    expected = torch.softmax(torch.tanh(scores / 0.25) * 0.25 + causal_mask(3), -1)
    assert torch.allclose(capped[4].weights, expected, atol=1e-6)
    assert torch.allclose(positional_scores(capped, 0.25), torch.tanh(scores / 0.25) * 0.25)
    masked = _three_token_stages(mask_every_stage=True)
    for stage in masked[:4]:
        assert stage.weights.triu(1).abs().max() == 0
        assert stage.allowed.equal(torch.ones(3, 3, dtype=torch.bool).tril())


def test_stage_two_divides_by_sqrt_head_dim_not_the_width_of_x() -> None:
    x = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 1.0, 1.0, 3.0]])  # d_model = 4
    w = torch.zeros(4, 1)  # d_k = 1 (the projections do not enter stage 2)
    stages = reconstruction_stages(x, w_q=w, w_k=w, scaling=1.0)
    assert torch.allclose(stages[1].scores, x @ x.T)  # ÷ sqrt(1), not ÷ sqrt(4)
    assert [s.divisor for s in stages[:2]] == [1.0, 1.0]
    wide = reconstruction_stages(x, w_q=torch.zeros(4, 9), w_k=torch.zeros(4, 9), scaling=1 / 3)
    assert torch.allclose(wide[1].scores, x @ x.T / 3) and wide[1].divisor == pytest.approx(3.0)


def test_biases_and_prescale_enter_stage_three() -> None:
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    stages = reconstruction_stages(
        x, w_q=torch.eye(2), w_k=torch.eye(2), b_q=torch.tensor([1.0, 0.0]), scaling=1.0, query_prescale=2.0
    )
    # q = 2·(x + (1, 0)) = (4, 0), (2, 2); k = x → q·kᵀ = [[4, 0], [2, 2]]
    assert torch.allclose(stages[2].scores, torch.tensor([[4.0, 0.0], [2.0, 2.0]]))
    assert torch.allclose(stages[2].scores, stages[3].scores)  # no rotary: positions already in x
    assert stages[2].scale == 2.0


# --- every family: stage 5 is the model's own map -----------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_stage_five_equals_eager_output_attentions(name: str, tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models[name]
    encoded = inspector.encode(loaded, TINY_TEXT)
    # A fresh, identical copy gives the eager reference: output_attentions leaves transformers' (inert) output
    # hooks on a model, and the session's tiny models must stay hook-free for the reliability tests.
    twin = build_family(name)
    reference = eager_reference(twin, input_ids=encoded.input_ids, attention_mask=encoded.attention_mask)
    for layer in range(loaded.facts.num_layers):
        for head in range(loaded.facts.num_heads):
            inputs = inspector.execute(plan_head_inputs(inspector, loaded, encoded, layer, [head]))
            stages = reconstruct(inputs)
            eager = reference.attentions[layer][0, head]
            assert (stages[-1].weights - eager).abs().max().item() <= ATOL, (name, layer, head)
            assert (stages[-1].weights - inputs.weights[head]).abs().max().item() <= ATOL
            assert (positional_scores(stages, inputs.softcap) - inputs.scores).abs().max().item() <= ATOL


@pytest.mark.parametrize("name", FAMILIES)
def test_reconstruct_tool_on_tiny_families(name: str, tiny_models, inspector: Inspector) -> None:
    report = get_tool("reconstruct_attention")(
        inspector, {"model": f"tiny-{name}", "text": TINY_TEXT, "layer": 1, "head": 1}
    )
    assert isinstance(report, AttentionReconstruction)
    assert report.matches_model and report.model_weight_error <= ATOL and report.positional_score_error <= ATOL
    assert [s.stage for s in report.stages] == [1, 2, 3, 4, 5]
    last = report.stages[-1]
    assert last.mean_js_to_model == 0.0 and last.top_key_agreement == 1.0 and last.masked
    assert all(len(s.top_keys) == len(report.tokens) for s in report.stages)
    assert f"sqrt({report.head_dim})" in report.stages[1].added  # d_k, not the hidden size 32
    assert report.stages[1].divisor == pytest.approx(math.sqrt(report.head_dim), abs=1e-5)
    if name in {"gpt2", "bert", "opt"}:
        assert "already in x" in report.stages[3].added
        assert report.stages[2].mean_entropy == report.stages[3].mean_entropy
    else:
        assert "RoPE" in report.stages[3].added
    if name == "gpt_neox":
        assert "2 of 8 dims rotated" in report.stages[3].added
    if name == "gemma2":
        assert report.softcap == 2.0 and "soft-capped" in last.added
    if name == "mistral":
        assert report.mask == "causal with a sliding window of 4 keys"
    if name == "bert":
        assert report.mask.startswith("none")
    if name in {"llama", "qwen2", "opt", "phi3"}:
        assert report.mask == "causal"
    for stage in report.stages[:4]:
        assert stage.masked is False
    decisive = next(f for f in report.findings if f.kind == "decisive_stage")
    assert decisive.value is not None and decisive.value >= 0


def test_reconstruct_tool_options(tiny_models, inspector: Inspector) -> None:
    report = get_tool("reconstruct_attention")(
        inspector,
        {"model": "tiny-llama", "text": TINY_TEXT, "layer": 0, "head": 2, "mask_every_stage": True, "png": True},
    )
    for stage in report.stages:
        assert stage.masked
        assert all(row.key_position <= row.position for row in stage.top_keys)  # causal at every stage
        assert stage.mean_js_to_model == stage.masked_js_to_model
        assert stage.png_path and f"-{stage.stage}-{stage.name}-" in stage.png_path
        assert Path(stage.png_path).is_file()


def test_query_chunks_do_not_change_the_reconstruction(tiny_models, inspector: Inspector, monkeypatch) -> None:
    whole = get_tool("reconstruct_attention")(
        inspector, {"model": "tiny-phi3", "text": TINY_TEXT, "layer": 1, "head": 0}
    )
    monkeypatch.setattr(Inspector, "query_chunk", lambda self, loaded, length: 4)
    chunked = get_tool("reconstruct_attention")(
        inspector, {"model": "tiny-phi3", "text": TINY_TEXT, "layer": 1, "head": 0}
    )
    assert chunked.model_weight_error <= ATOL
    assert [s.mean_entropy for s in chunked.stages] == [s.mean_entropy for s in whole.stages]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"layer": 5, "head": 0}, r"layer 5 out of range 0\.\.1"),
        ({"layer": 0, "head": 9}, r"head 9 out of range 0\.\.3"),
        ({"layer": 0, "head": 0, "text": ""}, "empty"),
    ],
)
def test_reconstruct_bad_input(arguments, message, tiny_models, inspector: Inspector) -> None:
    with pytest.raises(InvalidInputError, match=message):
        get_tool("reconstruct_attention")(inspector, {"model": "tiny-gpt2", "text": TINY_TEXT, **arguments})


# --- the bundled models ---------------------------------------------------------------------------------------
@pytest.mark.real_model
@pytest.mark.parametrize(("model", "layer", "head"), [("smollm2-135m-instruct", 3, 0), ("minilm-l6", 2, 5)])
def test_reconstruct_real_models(model: str, layer: int, head: int, smol, minilm, inspector: Inspector) -> None:
    loaded = smol if model.startswith("smol") else minilm
    report = get_tool("reconstruct_attention")(
        inspector, {"model": model, "text": SAMPLE_TEXT, "layer": layer, "head": head}
    )
    assert report.matches_model and report.model_weight_error <= ATOL
    encoded = inspector.encode(loaded, SAMPLE_TEXT)
    reference = eager_reference(loaded.model, input_ids=encoded.input_ids, attention_mask=encoded.attention_mask)
    inputs = inspector.execute(plan_head_inputs(inspector, loaded, encoded, layer, [head]))
    stages = reconstruct(inputs)
    assert (stages[-1].weights - reference.attentions[layer][0, head]).abs().max().item() <= ATOL
    assert (positional_scores(stages) - inputs.scores).abs().max().item() <= ATOL
    assert report.hidden_size == loaded.facts.hidden_size
    assert f"sqrt({loaded.facts.head_dim})" in report.stages[1].added
