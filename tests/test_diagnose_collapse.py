"""diagnose_collapse: hand-computed statistics on 4-token maps, the Zhai et al. bound, value-side norms, streaming,
bad input, and the real models."""

from __future__ import annotations

import math

import pytest
import torch
from families import build_family
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import SAMPLE_TEXT, collapse_statistics

from agent_tools.analysis.collapse import (
    ROW_TARGETS,
    centred_logit_norm,
    centred_score_norm,
    row_targets,
    zhai_entropy_bound,
)
from agent_tools.analysis.metrics import attention_entropy
from agent_tools.analysis.norms import (
    head_output_grams,
    head_output_norms,
    norm_shares,
    transformed_value_norms,
    value_share_sums,
)
from agent_tools.capture import capture_attention, repeat_kv
from agent_tools.consumers.collapse import CollapseConsumer, output_grams_for
from agent_tools.errors import InvalidInputError
from agent_tools.families import find_attention_modules
from agent_tools.inspector import Inspector
from agent_tools.layout import output_weight
from agent_tools.tools import get_tool
from agent_tools.tools.diagnose_collapse import CollapseReport


def entropy_lower_bound(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """(..., q, k) pre-mask scores -> (..., q): the Zhai et al. bound for each row over its visible keys."""
    count = allowed.expand(scores.shape).sum(-1)
    return zhai_entropy_bound(centred_score_norm(scores, allowed).double(), count)


# --- a 4-token causal example computed on paper ----------------------------------------------------------

SINK_ROWS = [[1.0, 0, 0, 0], [0.9, 0.1, 0, 0], [0.8, 0.1, 0.1, 0], [0.7, 0.1, 0.1, 0.1]]
SELF_ROWS = [[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.0]]
PREVIOUS_ROWS = [[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]]
CAUSAL = torch.ones(4, 4, dtype=torch.bool).tril()
FIRST_IS_SINK = torch.tensor([True, False, False, False])


def _hand_example():
    weights = torch.tensor([SINK_ROWS, SINK_ROWS, SELF_ROWS, PREVIOUS_ROWS], dtype=torch.float64)  # (4, 4, 4)
    scores = weights.clamp_min(1e-12).log()  # softmax(scores) over visible keys ≈ weights
    value_norms = torch.tensor(
        [[0.1, 2.0, 2.0, 2.0], [3.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64
    )
    return weights, scores, value_norms


def test_hand_computed_statistics_on_four_tokens() -> None:
    weights, scores, value_norms = _hand_example()
    stats = collapse_statistics(
        weights, scores, CAUSAL, FIRST_IS_SINK, threshold=0.8, value_norms=value_norms
    )  # row 0 sees one key and is left out: rows 1..3 count
    sink, harmful, self_head, previous = stats
    h1 = -(0.9 * math.log(0.9) + 0.1 * math.log(0.1))
    h2 = -(0.8 * math.log(0.8) + 2 * 0.1 * math.log(0.1))
    h3 = -(0.7 * math.log(0.7) + 3 * 0.1 * math.log(0.1))
    assert sink.rows == 3
    assert sink.mean_entropy == pytest.approx((h1 + h2 + h3) / 3, abs=1e-6)
    assert sink.mean_normalised_entropy == pytest.approx(
        (h1 / math.log(2) + h2 / math.log(3) + h3 / math.log(4)) / 3, abs=1e-6
    )
    assert sink.mean_max_weight == pytest.approx(0.8)
    assert sink.saturated_fraction == pytest.approx(2 / 3)  # 0.9 and 0.8 reach the threshold 0.8
    assert (sink.dominant_position, sink.dominant_share, sink.sink_fraction) == (0, pytest.approx(0.8), 1.0)
    assert sink.concentration == "sink" and sink.concentrated
    # value side: the sink writes 0.8 × 0.1 = 0.08 against 2.0 for an ordinary key
    assert sink.dominant_contribution == pytest.approx(0.08)
    assert sink.contribution_ratio == pytest.approx(0.04)
    assert sink.value_norm_ratio == pytest.approx(0.05)
    assert sink.dominant_value_share == pytest.approx((0.09 / 0.29 + 0.08 / 0.48 + 0.07 / 0.67) / 3)
    assert sink.verdict == "no_op_sink"
    # the same weights with a large sink value: 0.8 × 3 against 1 -> a writing collapse (value side)
    assert harmful.contribution_ratio == pytest.approx(2.4)
    assert harmful.verdict == "writing_collapse"
    assert self_head.mean_entropy == pytest.approx(0.0, abs=1e-9) and self_head.self_fraction == 1.0
    assert (self_head.concentration, self_head.verdict) == ("self", "positional")
    assert previous.previous_fraction == pytest.approx(2 / 3) and previous.sink_fraction == pytest.approx(1 / 3)
    assert (previous.concentration, previous.verdict) == ("previous_token", "positional")
    assert all(s.bound_violations == 0 for s in stats)


def test_one_content_token_whatever_the_query_bidirectional() -> None:
    # [CLS] w w [SEP]: every query puts 0.97 on key 2, a content token
    row = [0.01, 0.01, 0.97, 0.01]
    weights = torch.tensor([[row] * 4], dtype=torch.float64)
    sinks = torch.tensor([True, False, False, True])
    everything = torch.ones(4, 4, dtype=torch.bool)
    (stats,) = collapse_statistics(
        weights,
        weights.log(),
        everything,
        sinks,
        value_norms=torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.float64),
    )
    assert stats.rows == 4 and stats.dominant_position == 2 and stats.top_other_position == 2
    assert stats.top_other_fraction == 1.0 and stats.concentration == "fixed_token"
    assert stats.self_fraction == pytest.approx(0.25)  # query 2 reads itself
    assert stats.verdict == "writing_collapse" and stats.contribution_ratio == pytest.approx(0.97)
    expected = -(0.97 * math.log(0.97) + 3 * 0.01 * math.log(0.01))
    assert stats.mean_entropy == pytest.approx(expected, abs=1e-9)
    assert stats.mean_normalised_entropy == pytest.approx(expected / math.log(4), abs=1e-9)


def test_row_targets_priority() -> None:
    argmax = torch.tensor([0, 1, 1, 3])
    codes = row_targets(argmax, torch.arange(4), FIRST_IS_SINK)
    assert [ROW_TARGETS[c] for c in codes.tolist()] == ["sink", "self", "previous_token", "self"]


# --- the Zhai et al. bound ------------------------------------------------------------------------------


def test_bound_is_exact_for_two_keys_and_for_the_extremal_row() -> None:
    # Two logits: every row has the extremal form, so the bound is the entropy itself.
    for gap in (0.0, 0.3, 2.0, 9.0):
        z = torch.tensor([[gap, 0.0]], dtype=torch.float64)
        entropy = attention_entropy(torch.softmax(z, -1))
        assert entropy_lower_bound(z, torch.ones(1, 2, dtype=torch.bool)) == pytest.approx(float(entropy), abs=1e-12)
    # T = 3, one logit above two equal ones: tight too; r = ‖(2, -1, -1)‖ = sqrt(6) for z = (3, 0, 0)
    z = torch.tensor([[3.0, 0.0, 0.0]], dtype=torch.float64)
    allowed = torch.ones(1, 3, dtype=torch.bool)
    assert centred_score_norm(z, allowed) == pytest.approx(math.sqrt(6))
    p = torch.softmax(z, -1)
    assert entropy_lower_bound(z, allowed) == pytest.approx(float(attention_entropy(p)), abs=1e-12)
    # r = 0 (flat row) forces log T; one key gives 0
    assert zhai_entropy_bound(torch.tensor(0.0), torch.tensor(5)) == pytest.approx(math.log(5))
    assert zhai_entropy_bound(torch.tensor(3.0), torch.tensor(1)) == 0.0


def test_centred_norm_from_the_softmax_input_equals_the_scores_formula() -> None:
    # logits = scores + additive mask (0 where readable, dtype-min where not): masked entries must not count.
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 5, 7, generator=generator) * 4 + 2  # (h, q, k), offset so the mean matters
    allowed = torch.ones(5, 7, dtype=torch.bool).tril(2)
    logits = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
    # by hand for one row: head 1, row 0 sees keys 0..2
    row = scores[1, 0, :3].double()
    assert float(centred_logit_norm(logits, allowed)[1, 0]) == pytest.approx(float((row - row.mean()).norm()), rel=1e-5)
    assert torch.allclose(centred_logit_norm(logits, allowed), centred_score_norm(scores, allowed), rtol=1e-5)


def test_value_share_sums_equal_the_explicit_shares() -> None:
    generator = torch.Generator().manual_seed(4)
    weights = torch.softmax(torch.randn(2, 6, 5, generator=generator), -1)  # (h, q, k)
    norms = torch.rand(2, 5, generator=generator) + 0.1
    norms[1, :] = 0.0  # a head whose values write nothing: every share is 0, not NaN
    explicit = norm_shares(weights * norms[:, None, :]).sum(1)  # (h, k): each row's shares of ‖α_ij v_j W_O^h‖
    assert torch.allclose(value_share_sums(weights, norms), explicit, atol=1e-6)
    assert float(value_share_sums(weights, norms)[0].sum()) == pytest.approx(6.0, abs=1e-5)  # shares sum to 1 a row
    assert float(value_share_sums(weights, norms)[1].abs().sum()) == 0.0


def test_bound_uses_only_visible_keys() -> None:
    z = torch.tensor([[2.0, 0.0, 100.0]], dtype=torch.float64)  # the 100 is masked out
    allowed = torch.tensor([[True, True, False]])
    two = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    assert entropy_lower_bound(z, allowed) == pytest.approx(float(entropy_lower_bound(two, torch.ones(1, 2).bool())))


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=2, max_value=40),
    st.floats(min_value=0.01, max_value=30.0),
    st.integers(min_value=0, max_value=2**31 - 1),
)
def test_every_row_respects_the_bound(length: int, spread: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    z = spread * torch.randn(64, length, generator=generator, dtype=torch.float64)
    z[:8, 0] += 4 * spread  # some rows with one dominant logit, the shape the bound is tight for
    allowed = torch.rand(64, length, generator=generator) > 0.3  # random masks; key 0 always visible
    allowed[:, 0] = True
    weights = torch.softmax(z.masked_fill(~allowed, -math.inf), -1)
    entropy = attention_entropy(weights)
    assert bool((entropy >= entropy_lower_bound(z, allowed) - 1e-9).all())


def test_every_row_of_a_causal_model_respects_the_bound() -> None:
    model = build_family("llama")
    rows = []

    class Check:
        accepts_key_prefix = False

        def on_layer(self, layer) -> None:
            allowed = layer.allowed()
            entropy = attention_entropy(layer.weights.double())
            rows.append(entropy - entropy_lower_bound(layer.scores, allowed))

    with torch.inference_mode(), capture_attention(model, [Check()]):
        model(input_ids=torch.arange(6, 30)[None])
    slack = torch.cat([r.flatten() for r in rows])
    assert slack.numel() == 2 * 4 * 24 and float(slack.min()) >= -1e-5


# --- value-side norms -------------------------------------------------------------------------------------


def test_value_norms_match_the_materialised_products() -> None:
    torch.manual_seed(0)
    batch, kv_heads, groups, keys, head_dim, width = 1, 2, 2, 5, 4, 6
    heads = kv_heads * groups
    value = torch.randn(batch, kv_heads, keys, head_dim)
    o_weight = torch.randn(width, heads * head_dim)  # (C, H·D) like nn.Linear.weight
    weights = torch.softmax(torch.randn(batch, heads, 3, keys), -1)
    grams = head_output_grams(o_weight, heads)
    per_head = repeat_kv(value, groups)  # (B, H, k, D)
    slices = [o_weight[:, h * head_dim : (h + 1) * head_dim] for h in range(heads)]  # W_O^h (C, D)
    explicit = torch.stack([(per_head[0, h] @ slices[h].T).norm(dim=-1) for h in range(heads)])[None]  # (1, H, k)
    assert torch.allclose(transformed_value_norms(value, grams, kv_groups=groups), explicit, atol=1e-5)
    outputs = torch.stack([(weights[0, h] @ per_head[0, h]) @ slices[h].T for h in range(heads)])  # (H, q, C)
    assert torch.allclose(
        head_output_norms(weights, value, grams, kv_groups=groups)[0], outputs.norm(dim=-1), atol=1e-5
    )
    # the heads' slices add up to the output projection (without its bias)
    concat = (weights @ per_head).transpose(1, 2).reshape(batch, 3, heads * head_dim)
    assert torch.allclose(outputs.sum(0), (concat @ o_weight.T)[0], atol=1e-5)


@pytest.mark.parametrize(
    ("family", "attribute"),
    [("llama", "o_proj"), ("gpt2", "c_proj"), ("opt", "out_proj"), ("gpt_neox", "dense"), ("bert", None)],
)
def test_output_projection_per_family(family: str, attribute: str | None) -> None:
    model = build_family(family)
    module = find_attention_modules(model)[0]
    found = output_weight(model, 0)
    if attribute is None:  # BERT keeps it next to the self-attention: attention.output.dense
        expected = model.encoder.layer[0].attention.output.dense.weight
    else:
        child = getattr(module, attribute)
        expected = child.weight.t() if family == "gpt2" else child.weight
    assert torch.equal(found, expected)
    assert found.shape[1] == model.config.hidden_size  # H·D columns for these configs


def test_captured_value_is_the_normalised_input_times_w_v() -> None:
    model = build_family("llama")
    seen = {}

    class Keep:
        accepts_key_prefix = False

        def on_layer(self, layer) -> None:
            if layer.layer == 1:
                seen["value"], seen["input"] = layer.value.clone(), layer.layer_input.clone()

    with torch.inference_mode(), capture_attention(model, [Keep()], record_inputs=True):
        model(input_ids=torch.arange(6, 14)[None])
    module = find_attention_modules(model)[1]
    with torch.no_grad():
        projected = module.v_proj(seen["input"])  # (1, T, Hkv·D)
    batch, length, _ = projected.shape
    projected = projected.view(batch, length, -1, module.head_dim).transpose(1, 2)  # (1, Hkv, T, D)
    assert torch.allclose(projected, seen["value"], atol=1e-6)


# --- streaming ---------------------------------------------------------------------------------------------


def test_streaming_consumer_matches_whole_maps_and_chunks() -> None:
    model = build_family("llama")
    ids = torch.arange(6, 20)[None]
    sinks = torch.zeros(14, dtype=torch.bool)
    sinks[0] = True
    grams = output_grams_for(model, [0, 1], 4)
    whole, chunked = CollapseConsumer(sinks, output_grams=grams), CollapseConsumer(sinks, output_grams=grams)
    kept: dict[int, tuple] = {}

    class Keep:
        accepts_key_prefix = False

        def on_layer(self, layer) -> None:
            norms = transformed_value_norms(layer.value, grams[layer.layer], kv_groups=layer.kv_groups)[0]
            kept[layer.layer] = (layer.weights[0].clone(), layer.scores[0].clone(), layer.allowed()[0, 0], norms)

    with torch.inference_mode():
        with capture_attention(model, [whole, Keep()]):
            model(input_ids=ids)
        with capture_attention(model, [chunked], query_chunk=3):
            model(input_ids=ids)
    for a, b in zip(whole.results(), chunked.results(), strict=True):
        for name in ("mean_entropy", "mean_max_weight", "dominant_share", "dominant_value_share", "mean_output_norm"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), abs=1e-5)
        assert (a.dominant_position, a.verdict, a.concentration) == (b.dominant_position, b.verdict, b.concentration)
    for layer, (weights, scores, allowed, norms) in kept.items():
        direct = collapse_statistics(weights, scores, allowed, sinks, layer=layer, value_norms=norms)
        streamed = [s for s in whole.results() if s.layer == layer]
        for a, b in zip(direct, streamed, strict=True):
            assert a.mean_entropy == pytest.approx(b.mean_entropy, abs=1e-5)
            assert a.dominant_value_share == pytest.approx(b.dominant_value_share, abs=1e-5)


# --- the tool ----------------------------------------------------------------------------------------------


def test_tool_on_tiny_models(tiny_models, inspector: Inspector) -> None:
    for name in ("llama", "bert", "gpt2", "gemma2"):
        report = get_tool("diagnose_collapse")(
            inspector, {"model": f"tiny-{name}", "text": "the cat sat on the mat because it was tired", "top_k": 3}
        )
        assert isinstance(report, CollapseReport)
        assert report.heads_examined == 8 and len(report.heads) == 3 and report.bound_violations == 0
        assert report.sink_positions[0] == 0  # <bos>
        assert report.heads[0].mean_max_weight >= report.heads[-1].mean_max_weight - 0.1
    only = get_tool("diagnose_collapse")(
        inspector, {"model": "tiny-llama", "text": "the cat sat", "layers": [1], "heads": [0, 3], "top_k": 10}
    )
    assert {(h.layer, h.head) for h in only.heads} == {(1, 0), (1, 3)}


BAD = [
    ({"text": ""}, InvalidInputError, "empty"),
    ({"text": "the cat", "layers": [2]}, InvalidInputError, r"layers 2 out of range 0\.\.1"),
    ({"text": "the cat", "layers": []}, InvalidInputError, "empty list"),
    ({"text": "the cat", "heads": [4]}, InvalidInputError, r"heads 4 out of range 0\.\.3"),
    ({"text": "the cat", "heads": [1, 1]}, InvalidInputError, "duplicates"),
    ({"text": "the cat", "threshold": 0}, InvalidInputError, "threshold"),
    ({"text": "the cat", "threshold": 1.5}, InvalidInputError, "threshold"),
    ({"text": "the cat", "top_k": 0}, InvalidInputError, "top_k"),
    ({"text": "the cat", "baseline_draws": 1}, InvalidInputError, "baseline_draws"),
    ({"text": "the cat", "max_checked": 0}, InvalidInputError, "max_checked"),
]


@pytest.mark.parametrize(("arguments", "error", "message"), BAD)
def test_bad_input(tiny_models, inspector: Inspector, arguments, error, message) -> None:
    with pytest.raises(error, match=message):
        get_tool("diagnose_collapse")(inspector, {"model": "tiny-llama", **arguments})


@pytest.mark.real_model
def test_default_model_all_heads_in_one_forward(smol, inspector: Inspector, monkeypatch) -> None:
    calls = []
    original = Inspector.run

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Inspector, "run", counting)
    report = get_tool("diagnose_collapse")(inspector, {"text": SAMPLE_TEXT, "top_k": 5, "png": True})
    assert len(calls) == 1 and report.heads_examined == 270 and report.bound_violations == 0
    top = report.heads[0]
    assert top.dominant_position == 0 and top.concentration == "sink" and top.mean_max_weight > 0.95
    assert top.verdict == "no_op_sink" and top.contribution_ratio < 0.5
    assert sum(report.verdict_counts.values()) == 270 and report.png_path
    assert f"L{top.layer}H{top.head}" in report.summary


@pytest.mark.real_model
def test_minilm_sinks_are_cls_and_sep(minilm, inspector: Inspector) -> None:
    arguments = {"model": "minilm-l6", "text": SAMPLE_TEXT, "top_k": 72, "detail": "full"}
    report = get_tool("diagnose_collapse")(inspector, arguments)
    assert report.heads_examined == 72 and report.bound_violations == 0
    assert report.sink_positions == [0, report.num_tokens - 1]
    # most heads park their weight on [CLS]/[SEP], whose transformed values are small (Kobayashi et al.)
    parked = [h for h in report.heads if h.sink_fraction >= 0.5]
    assert len(parked) > 20 and all(h.value_norm_ratio < 1 for h in parked if h.dominant_position == 0)


def test_head_whose_values_are_all_zero_is_a_no_op_not_a_crash(inspector: Inspector) -> None:
    """A KV head with W_V = 0 writes nothing: no finite value-norm ratio exists, and the head is a no-op sink."""
    from families import tiny_tokenizer

    from agent_tools.loading import register_model

    model = build_family("llama")
    for module in find_attention_modules(model):
        with torch.no_grad():
            module.q_proj.weight.mul_(8.0)  # peaked maps: the zeroed heads concentrate on one key
            module.k_proj.weight.mul_(8.0)
            module.v_proj.weight[: module.head_dim].zero_()  # KV head 0 (query heads 0 and 1) writes nothing
    register_model("tiny-llama-silent", model, tiny_tokenizer())
    report = get_tool("diagnose_collapse")(
        inspector, {"model": "tiny-llama-silent", "text": SAMPLE_TEXT, "top_k": 8, "threshold": 0.5}
    )
    silent = [h for h in report.heads if h.head in (0, 1)]
    assert silent, "the zeroed heads were examined"
    for head in silent:
        assert head.value_norm_ratio is None and head.dominant_contribution == 0.0
        assert head.verdict != "writing_collapse"
    assert all(h.value_norm_ratio is None or math.isfinite(h.value_norm_ratio) for h in report.heads)


# --- the causal check: kinds named by what removing a head does, against random heads ----------------------

CIRCUIT_TEXT = "cat dog cat sun cat moon cat"


@pytest.fixture(scope="module")
def collapse_circuit_model() -> str:
    from crafted import circuit_tokenizer, collapse_circuit

    from agent_tools.loading import register_model

    register_model("collapse-circuit", collapse_circuit(), circuit_tokenizer(bos=False))
    return "collapse-circuit"


def test_kinds_by_hand() -> None:
    from agent_tools.analysis.collapse import collapse_kind

    assert collapse_kind("writing_collapse", "within", "within") == "constant_output"
    assert collapse_kind("no_op_sink", "within", None) == "no_op_sink"
    assert collapse_kind("no_op_sink", "raises", "within") == "load_bearing"  # the measured effect wins
    assert collapse_kind("writing_collapse", "within", "lowers") == "harmful"
    assert collapse_kind("writing_collapse", "raises", "lowers") == "mixed"


def test_planted_constant_output_and_load_bearing_heads(collapse_circuit_model, inspector: Inspector) -> None:
    """L1H2 writes a constant (its value is a bias): mean- and resample-ablation change the loss by exactly 0, so it
    is a constant-output head, not harmful, although its value norms equal an ordinary key's. L1H1 writes the first
    word everywhere: mean-ablation is exactly 0 (its output is the same at every position) but resample-ablation
    from a text whose first word differs raises the loss far beyond the random heads (uniform heads writing
    aside: exactly 0 ± 0)."""
    arguments = {
        "model": collapse_circuit_model,
        "text": CIRCUIT_TEXT,
        "heads": [1, 2, 3],
        "resample_text": "dog dog dog dog dog dog dog dog",
    }
    report = get_tool("diagnose_collapse")(inspector, arguments)
    check = report.check
    assert check is not None and check.measure == "next_token_loss"
    assert check.resample_source == "the first 7 tokens of resample_text"
    kinds = {(c.layer, c.head): c for c in check.heads}
    constant, bearing = kinds[(1, 2)], kinds[(1, 1)]
    assert constant.verdict == "writing_collapse" and constant.kind == "constant_output"
    assert constant.mean_ablation.effect == 0.0 and constant.resample_ablation is not None
    assert constant.resample_ablation.effect == 0.0
    assert bearing.kind == "load_bearing" and bearing.mean_ablation.effect == 0.0
    assert bearing.resample_ablation is not None and bearing.resample_ablation.direction == "raises"
    assert bearing.resample_ablation.effect > 0.5
    # the baseline: every one of the 4 non-collapsed heads (fewer than the 8 draws asked, said so), all exactly 0
    assert check.baseline is not None and check.baseline.draws == 4 and check.baseline.heads_per_draw == 1
    assert check.baseline.mean_ablation == (0.0, 0.0) and check.baseline.resample_ablation == (0.0, 0.0)
    assert any("4 draws" in note for note in check.notes)
    assert check.together_baseline is not None and check.together_baseline.draws == 6  # C(4, 2)
    # the resample effect equals an unbatched resample-ablation of the same head
    loaded = inspector.model(collapse_circuit_model)
    encoded = inspector.encode(loaded, CIRCUIT_TEXT)
    other = inspector.encode(loaded, arguments["resample_text"]).input_ids[:, : encoded.length]
    alone = inspector.ablate(loaded, encoded.input_ids, None, [(1, 1)], method="resample", resample_ids=other)
    from agent_tools.analysis.metrics import next_token_losses

    change = (
        next_token_losses(alone.ablated, encoded.input_ids).mean()
        - next_token_losses(alone.clean, encoded.input_ids).mean()
    )
    assert bearing.resample_ablation.effect == pytest.approx(float(change), abs=1e-5)
    # the words say what was measured, and nothing is called harmful
    assert "L1H2 is a constant-output head (mean-ablation +0.0000 nats" in report.summary
    assert "L1H1 is load-bearing" in report.summary and "removing it raises the loss by" in report.summary
    assert "None is harmful" in report.summary
    assert [f.kind for f in report.findings[:2]] == ["load_bearing", "constant_output"]
    assert report.findings[1].severity == "low"
    rows = {(h.layer, h.head): h for h in report.heads}
    assert rows[(1, 2)].kind == "constant_output" and rows[(0, 1)].kind is None


def test_default_resample_source_is_a_stated_shuffle(collapse_circuit_model, inspector: Inspector) -> None:
    arguments = {"model": collapse_circuit_model, "text": CIRCUIT_TEXT, "heads": [1, 2, 3]}
    report = get_tool("diagnose_collapse")(inspector, arguments)
    assert report.check is not None
    assert report.check.resample_source == "the text's own tokens in a seeded random order (seed 0)"
    with pytest.raises(InvalidInputError, match=r"resample_text is 2 tokens; .* at least 7"):
        get_tool("diagnose_collapse")(inspector, {**arguments, "resample_text": "dog dog"})
    off = get_tool("diagnose_collapse")(inspector, {**arguments, "causal_check": False})
    assert off.check is None and "Not checked by ablation" in off.summary


def test_no_baseline_when_every_examined_head_collapsed(collapse_circuit_model, inspector: Inspector) -> None:
    arguments = {"model": collapse_circuit_model, "text": CIRCUIT_TEXT, "layers": [1], "heads": [1, 2]}
    report = get_tool("diagnose_collapse")(inspector, arguments)
    assert report.check is not None and report.check.baseline is None
    assert any("no baseline" in note and "has 0 to draw from" in note for note in report.check.notes)
    assert all(c.mean_ablation.direction == "within" for c in report.check.heads)  # nothing to compare with
