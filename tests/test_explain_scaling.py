"""explain_scaling and scaling_experiment: closed forms vs autograd, dH/dβ ≤ 0 on every row, hand-computed
3-token values, the streaming consumer against whole maps, the synthetic demonstration, the training experiment,
bad input, and the real models."""

from __future__ import annotations

import math

import pytest
import torch
from families import build_family
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import SAMPLE_TEXT

from agent_tools.analysis.metrics import attention_entropy, masked_softmax
from agent_tools.analysis.scaling import (
    predicted_dot_variance,
    row_measures,
    synthetic_scaling_demo,
    train_retrieval,
)
from agent_tools.capture import capture_attention
from agent_tools.consumers.scaling import ScalingConsumer
from agent_tools.errors import InvalidInputError
from agent_tools.families import read_facts
from agent_tools.inspector import Inspector
from agent_tools.tools import get_tool
from agent_tools.tools.explain_scaling import ScalingReport
from agent_tools.tools.scaling_experiment import ScalingExperimentReport

LN2 = math.log(2)


def entropy_beta_derivative(z: torch.Tensor, beta: float, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """dH/dβ of softmax(β z) in the closed form ScalingConsumer sums: −β (E_p[z²] − E_p[z]²) over the visible keys."""
    p = masked_softmax(beta * z, allowed)
    visible = z if allowed is None else z.masked_fill(~allowed, 0.0)
    return -beta * ((p * visible * visible).sum(-1) - (p * visible).sum(-1) ** 2).clamp_min(0.0)


# --- hand-computed on three tokens ----------------------------------------------------------------------


def test_three_token_row_by_hand() -> None:
    z = torch.tensor([LN2, 0.0, 0.0], dtype=torch.float64)  # softmax = (1/2, 1/4, 1/4)
    p = torch.softmax(z, -1)
    assert torch.allclose(p, torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64))
    measures = row_measures(p[None])
    assert measures.entropy.item() == pytest.approx(1.5 * LN2)  # ½ ln 2 + ½ ln 4
    assert measures.normalised_entropy.item() == pytest.approx(1.5 * LN2 / math.log(3))
    assert measures.max_weight.item() == 0.5 and not measures.saturated.item()
    # J = [[1/4, -1/8, -1/8], [-1/8, 3/16, -1/16], [-1/8, -1/16, 3/16]]
    expected = torch.tensor([[4, -2, -2], [-2, 3, -1], [-2, -1, 3]], dtype=torch.float64) / 16
    assert torch.allclose(torch.autograd.functional.jacobian(lambda x: torch.softmax(x, -1), z), expected)
    assert measures.jacobian_trace.item() == pytest.approx(0.625)  # 1 − (1/4 + 1/16 + 1/16)
    assert measures.jacobian_frobenius.item() == pytest.approx(math.sqrt(0.203125))  # 13/64
    # Var_p(z) = ½ (ln2)² − (½ ln2)² = ¼ (ln2)²; dH/dβ at β = 1 is −¼ (ln2)²
    assert entropy_beta_derivative(z, 1.0).item() == pytest.approx(-0.25 * LN2**2)


def test_predicted_variance_by_hand() -> None:
    q_var, k_var = torch.tensor([1.0, 4.0]), torch.tensor([2.0, 1.0])
    zero = torch.zeros(2)
    isotropic, independent = predicted_dot_variance(zero, q_var, zero, k_var)
    assert isotropic.item() == pytest.approx(2.5 * 1.5 * 2) and independent.item() == pytest.approx(1 * 2 + 4 * 1)
    q_mean, k_mean = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    _, with_means = predicted_dot_variance(q_mean, q_var, k_mean, k_var)
    assert with_means.item() == pytest.approx(6 + 4 * 4 + 1 * 2)
    # and Monte Carlo agrees with the independent-components formula
    generator = torch.Generator().manual_seed(0)
    n = 400_000
    q = q_mean + q_var.sqrt() * torch.randn(n, 2, generator=generator, dtype=torch.float64)
    k = k_mean + k_var.sqrt() * torch.randn(n, 2, generator=generator, dtype=torch.float64)
    assert (q * k).sum(-1).var().item() == pytest.approx(24, rel=0.03)


def test_masked_softmax_hides_keys() -> None:
    weights = masked_softmax(torch.tensor([[1.0, 5.0, 1.0]]), torch.tensor([[True, False, True]]))
    assert torch.equal(weights, torch.tensor([[0.5, 0.0, 0.5]]))


# --- closed forms vs autograd ---------------------------------------------------------------------------


def test_jacobian_closed_forms_match_autograd() -> None:
    generator = torch.Generator().manual_seed(1)
    for length in (2, 3, 7, 20):
        for scale in (0.1, 1.0, 5.0, 30.0):
            z = scale * torch.randn(length, generator=generator, dtype=torch.float64)
            jacobian = torch.autograd.functional.jacobian(lambda x: torch.softmax(x, -1), z)
            measures = row_measures(torch.softmax(z, -1)[None])
            assert measures.jacobian_trace.item() == pytest.approx(torch.trace(jacobian).item(), abs=1e-12)
            assert measures.jacobian_frobenius.item() == pytest.approx(jacobian.norm().item(), abs=1e-10)


def test_entropy_derivative_matches_autograd_on_every_row() -> None:
    generator = torch.Generator().manual_seed(2)
    z = 3 * torch.randn(50, 9, generator=generator, dtype=torch.float64)
    allowed = torch.ones(50, 9, dtype=torch.bool).tril(diagonal=0)
    allowed[:, 0] = True
    for beta_value in (0.05, 0.5, 1.0, 4.0):
        beta = torch.tensor(beta_value, dtype=torch.float64, requires_grad=True)
        entropy = attention_entropy(masked_softmax(beta * z, allowed))
        grads = torch.stack([torch.autograd.grad(e, beta, retain_graph=True)[0] for e in entropy])
        closed = entropy_beta_derivative(z, beta_value, allowed)
        assert torch.allclose(closed, grads, atol=1e-9)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(min_value=2, max_value=64),
    st.floats(min_value=0.01, max_value=50.0),
    st.integers(min_value=0, max_value=2**31 - 1),
)
def test_entropy_never_rises_with_the_scale(length: int, spread: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    z = spread * torch.randn(16, length, generator=generator, dtype=torch.float64)
    betas = torch.tensor([0.0, 0.01, 0.1, 0.3, 1.0, 2.0, 8.0, 64.0], dtype=torch.float64)
    entropies = torch.stack([attention_entropy(torch.softmax(b * z, -1)) for b in betas])  # (β, rows)
    assert bool((entropies[1:] <= entropies[:-1] + 1e-12).all())


# --- the synthetic demonstration ----------------------------------------------------------------------


def test_synthetic_demonstration() -> None:
    rows = synthetic_scaling_demo()
    assert [r.head_dim for r in rows] == [16, 64, 256, 1024]
    for row in rows:
        assert row.dot_variance == pytest.approx(row.head_dim, rel=0.1)
        assert row.scaled_variance == pytest.approx(1.0, rel=0.1)
        assert row.scaled["saturated_fraction"] == 0.0 and row.scaled["jacobian_trace"] > 0.9
    saturated = [r.unscaled["saturated_fraction"] for r in rows]
    trace = [r.unscaled["jacobian_trace"] for r in rows]
    assert saturated == sorted(saturated) and saturated[-1] > 0.5
    assert trace == sorted(trace, reverse=True) and trace[-1] < 0.1
    assert synthetic_scaling_demo(seed=3)[0] == synthetic_scaling_demo(seed=3)[0]


# --- streaming over a layer -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma2", "opt", "bert"])
def test_consumer_matches_whole_maps_and_chunks(family: str) -> None:
    model = build_family(family)
    facts = read_facts(model)
    ids = torch.arange(6, 18)[None]
    temperatures = [0.5, 2.0]
    whole = ScalingConsumer(1, [0, 3], temperatures, model_scale=facts.scaling, query_prescaled=facts.query_prescaled)
    chunked = ScalingConsumer(1, [0, 3], temperatures, model_scale=facts.scaling, query_prescaled=facts.query_prescaled)
    kept = {}

    class Keep:
        accepts_key_prefix = False

        def on_layer(self, layer) -> None:
            if layer.layer == 1:
                kept["weights"] = layer.weights[0, [0, 3]].double()
                kept["allowed"] = layer.allowed()[0, 0]
                query = layer.query[0, [0, 3]].double() / (facts.scaling if facts.query_prescaled else 1.0)
                kept["raw"] = query @ layer.head_key(layer.key)[0, [0, 3]].double().transpose(-1, -2)

    with torch.inference_mode():
        with capture_attention(model, [whole, Keep()]):
            model(input_ids=ids)
        with capture_attention(model, [chunked], query_chunk=5):
            model(input_ids=ids)
    variances, other = whole.variances(), chunked.variances()
    for name in variances:
        assert torch.allclose(variances[name], other[name], rtol=1e-6, atol=1e-8)
    visible = kept["allowed"].expand(kept["raw"].shape)  # the population variance over each head's visible pairs
    raw_variance = torch.stack([raw[mask].var(unbiased=False) for raw, mask in zip(kept["raw"], visible, strict=True)])
    assert torch.allclose(variances["raw_variance"], raw_variance, rtol=1e-6)
    assert torch.allclose(variances["scaled_variance"], variances["raw_variance"] * facts.scaling**2, rtol=1e-6)
    # the model_scale setting reproduces the model's own weights: same mean entropy over rows that can choose
    keep = kept["allowed"].sum(-1) > 1
    model_setting = next(s for s in whole.settings if s.kind == "model_scale")
    expected = attention_entropy(kept["weights"][:, keep]).mean().item()
    assert model_setting.means()["entropy"] == pytest.approx(expected, abs=1e-5)
    assert whole.monotone_violations == 0 and whole.monotone_rows == 2 * int(keep.sum())
    for a, b in zip(whole.settings, chunked.settings, strict=True):
        assert a.means() == pytest.approx(b.means(), abs=1e-6)
    unscaled = next(s for s in whole.settings if s.kind == "no_scaling")
    assert unscaled.in_family is (facts.softcap is None)


# --- the tools --------------------------------------------------------------------------------------------


def test_explain_scaling_tool_on_tiny_models(tiny_models, inspector: Inspector) -> None:
    report = get_tool("explain_scaling")(
        inspector, {"model": "tiny-llama", "text": "the cat sat on the mat because it was tired", "layer": 1}
    )
    assert isinstance(report, ScalingReport)
    assert report.head_dim == 8 and report.standard_scale and report.heads == [0, 1, 2, 3]
    assert report.entropy_monotone and report.monotonicity_violations == 0
    assert [s.kind for s in report.settings].count("temperature") == 4 and len(report.synthetic) == 4
    betas = [s.beta for s in report.settings]
    assert betas == sorted(betas) and next(s for s in report.settings if s.kind == "no_scaling").beta == 1.0
    entropies = [s.entropy for s in report.settings]
    assert entropies == sorted(entropies, reverse=True)  # a larger β never raises the mean entropy either
    single = get_tool("explain_scaling")(
        inspector,
        {"model": "tiny-gemma2", "text": "the cat sat", "layer": 0, "head": 2, "temperatures": [3], "synthetic": False},
    )
    assert single.heads == [2] and single.softcap == 2.0 and not single.standard_scale and single.synthetic == []
    assert {s.kind for s in single.settings} == {"temperature", "model_scale", "no_scaling"}


SCALING_BAD = [
    ({"text": "", "layer": 0}, "empty"),
    ({"text": "the cat", "layer": 2}, r"layer 2 out of range 0\.\.1"),
    ({"text": "the cat", "layer": 0, "head": 4}, r"head 4 out of range 0\.\.3"),
    ({"text": "the cat", "layer": 0, "head": -1}, r"out of range 0\.\.3"),
    ({"text": "the cat", "layer": 0, "temperatures": [0.0]}, "temperatures.0: Input should be greater than 0"),
    ({"text": "the cat", "layer": 0, "temperatures": [1.0, -2.0]}, "temperatures.1: Input should be greater than 0"),
    (
        {"text": "the cat", "layer": 0, "temperatures": [float("nan")]},
        "temperatures.0: Input should be a finite number",
    ),
    (
        {"text": "the cat", "layer": 0, "temperatures": [float("inf")]},
        "temperatures.0: Input should be a finite number",
    ),
    ({"text": "the cat", "layer": 0, "temperatures": []}, "temperatures"),
]


@pytest.mark.parametrize(("arguments", "message"), SCALING_BAD)
def test_explain_scaling_bad_input(tiny_models, inspector: Inspector, arguments, message) -> None:
    with pytest.raises(InvalidInputError, match=message):
        get_tool("explain_scaling")(inspector, {"model": "tiny-llama", **arguments})


def test_retrieval_training_is_deterministic_and_shows_the_failure() -> None:
    first = train_retrieval(1024, scaled=False, steps=100, seed=0)
    assert first == train_retrieval(1024, scaled=False, steps=100, seed=0)
    scaled = train_retrieval(1024, scaled=True, steps=100, seed=0)
    assert first.saturated_fraction[0] > 0.5 and scaled.saturated_fraction[0] == 0.0
    assert first.attention_entropy[0] < 0.5 < scaled.attention_entropy[0]
    assert scaled.loss[-1] < 0.1 < first.loss[-1]
    assert first.grad_norm_q[0] > 10 * scaled.grad_norm_q[0]  # the unscaled gradient is erratic: huge, then ~0
    assert min(first.grad_norm_q) < 1e-6


def test_scaling_experiment_tool(inspector: Inspector) -> None:
    arguments = {"steps": 100, "small_head_dim": 16, "large_head_dim": 256, "seed": 1}
    report = get_tool("scaling_experiment")(inspector, arguments)
    assert isinstance(report, ScalingExperimentReport)
    assert [(r.head_dim, r.scaled) for r in report.runs] == [(16, True), (16, False), (256, True), (256, False)]
    assert all(len(r.loss) == len(r.steps) == len(r.grad_norm_q) == len(r.attention_entropy) for r in report.runs)
    assert report.runs[0].steps[-1] == 100
    assert report == get_tool("scaling_experiment")(inspector, arguments)  # deterministic for a seed
    by = {(r.head_dim, r.scaled): r for r in report.runs}
    assert by[256, True].final_loss < by[256, False].final_loss
    assert "d_k=256" in report.summary


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"small_head_dim": 64, "large_head_dim": 64}, "must be below large_head_dim"),
        ({"steps": 0}, "steps"),
        ({"learning_rate": float("nan")}, "finite"),
        ({"learning_rate": -1}, "greater than 0"),
        ({"model": "minilm-l6"}, "unknown argument 'model'"),
    ],
)
def test_scaling_experiment_bad_input(inspector: Inspector, arguments, message) -> None:
    with pytest.raises(InvalidInputError, match=message):
        get_tool("scaling_experiment")(inspector, arguments)


@pytest.mark.real_model
def test_explain_scaling_on_the_bundled_models(smol, minilm, inspector: Inspector) -> None:
    report = get_tool("explain_scaling")(inspector, {"text": SAMPLE_TEXT, "layer": 3})
    assert report.head_dim == 64 and report.scaling == pytest.approx(0.125) and report.standard_scale
    assert report.scaled_score_variance == pytest.approx(report.raw_score_variance / 64, rel=1e-3)
    assert report.entropy_monotone and report.rows_checked == 9 * (report.num_tokens - 1)
    unscaled = next(s for s in report.settings if s.kind == "no_scaling")
    model_setting = next(s for s in report.settings if s.kind == "model_scale")
    assert unscaled.saturated_fraction > model_setting.saturated_fraction
    assert unscaled.jacobian_trace < model_setting.jacobian_trace
    bert = get_tool("explain_scaling")(
        inspector, {"model": "minilm-l6", "text": SAMPLE_TEXT, "layer": 2, "head": 5, "synthetic": False}
    )
    assert bert.head_dim == 32 and bert.scaling == pytest.approx(1 / math.sqrt(32), abs=1e-6)
    assert bert.entropy_monotone and bert.rows_checked == bert.num_tokens
