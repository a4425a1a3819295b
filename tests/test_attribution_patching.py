"""Attribution patching: the estimate equals the derivative exact patching measures (finite differences through
the batched patched forwards), GradDrop's score is hand-derivable for a last-layer head, the sizing helpers give
hand-computed numbers, the segment estimate is verified by exact segment ablation, and a model without float
embeddings is refused."""

from __future__ import annotations

import math

import pytest
import torch
from crafted import circuit_tokenizer, induction_circuit

from agent_tools.analysis.attribution_patching import (
    LARGE_FLOOR,
    effect_size,
    grad_drop_scores,
    head_estimates,
    minimum_gap,
    top_token_change,
    verify,
)
from agent_tools.analysis.metrics import Baseline
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel, register_model
from agent_tools.runner.attribution_patching import mlp_patched_logits
from agent_tools.runner.patching import HeadPatch, recorded_run

CLEAN, CORRUPTED = "the cat sat on the mat because it", "the dog sat on the mat because it"


# --- pure numbers --------------------------------------------------------------------------------------------------
def test_head_estimates_are_the_difference_times_the_gradient_summed_over_dims() -> None:
    clean = torch.tensor([[[1.0, 2.0], [0.0, 1.0]]])  # (T=1, H=2, D=2)
    corrupted = torch.tensor([[[0.0, 1.0], [1.0, 1.0]]])
    gradient = torch.tensor([[[3.0, -1.0], [2.0, 5.0]]])
    # head 0: (1, 1)·(3, −1) = 2; head 1: (−1, 0)·(2, 5) = −2
    assert head_estimates(clean, corrupted, gradient).tolist() == [[2.0, -2.0]]


def _whole(output: torch.Tensor) -> tuple[torch.Tensor]:
    """A readout that keeps every row's whole output (tiny models only: the tests compare full logits)."""
    return (output.float(),)


def test_grad_drop_score_is_the_mean_absolute_dropped_estimate_over_l_minus_one() -> None:
    dropped = torch.tensor([[1.0, -2.0], [-3.0, 0.0], [2.0, 4.0]])  # (L=3, components=2)
    assert grad_drop_scores(dropped).tolist() == [3.0, 3.0]  # (1 + 3 + 2) / 2, (2 + 0 + 4) / 2


def test_baseline_effect_size_and_ties() -> None:
    reference = Baseline((0.1, 0.3, 0.2))  # mean 0.2; sample sd sqrt((0.01 + 0.01 + 0) / (3 − 1)) = 0.1
    assert (reference.mean, reference.spread, reference.draws) == pytest.approx((0.2, 0.1, 3))
    assert effect_size(0.2 + 3.01 * 0.1, reference) == "large"
    assert effect_size(0.2 - 0.29, reference) == "small"  # 2.9 spreads below the mean
    flat = Baseline((0.0,) * 8)
    assert effect_size(LARGE_FLOOR * 0.9, flat) == "small" and effect_size(LARGE_FLOOR * 1.1, flat) == "large"
    before = torch.tensor([2.0, 1.0, 0.0])
    # after: token 1 on top by ln(1.05) over token 0: p 0.4083 vs 0.4287 (< 0.02 apart) -> a tie, not a flip
    tied = top_token_change(before, torch.tensor([0.0, math.log(1.05), -0.5]))
    assert (tied.before, tied.after, tied.kind) == (0, 1, "tie")
    assert tied.p_after - tied.p_before == pytest.approx(0.05 / (2.05 + math.exp(-0.5)))
    assert top_token_change(before, torch.tensor([0.0, 1.0, 0.0])).kind == "flip"
    assert top_token_change(before, before).kind == "unchanged"
    logits = torch.tensor([1.0, 3.0, 5.0])  # standard deviation 2
    assert minimum_gap(logits) == pytest.approx(0.5)


def test_verification_numbers() -> None:
    estimates, exact = [5.0, 4.0, 0.1, 0.2], [4.5, -0.1, 3.0, 0.0]
    checked = verify(estimates, exact, top=[0, 1], k=2)
    assert checked.recall == 1  # the exact top 2 are items 0 and 2; the estimate's top 2 are 0 and 1
    assert checked.missed == 2  # the largest exact effect outside the estimate's top 2
    assert checked.spearman == pytest.approx(0.4)  # |estimate| ranks 1 2 4 3, |exact| ranks 1 3 2 4


# --- passes on tiny models -----------------------------------------------------------------------------------------
def _metric(answer: int, wrong: int):
    def metric(_clean: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, answer] - logits[:, wrong]

    return metric


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_estimate_is_the_derivative_exact_patching_measures(family: str, tiny_models, inspector) -> None:
    """Patch each head with z_corrupted + ε·(z_clean − z_corrupted) exactly (batched rows); (M(ε) − M(−ε)) / 2ε
    equals the attribution estimate of that head, and the per-position estimates sum to it."""
    loaded = tiny_models[family]
    clean, corrupted = inspector.encode(loaded, CLEAN), inspector.encode(loaded, CORRUPTED)
    answer, wrong = (loaded.tokenizer.convert_tokens_to_ids(w) for w in ("was", "tired"))
    passes = inspector.attribution_passes(loaded, clean, corrupted, _metric(answer, wrong), grad_drop=False)
    recorded = recorded_run(loaded, corrupted.input_ids).heads
    facts = loaded.facts
    heads = [(layer, head) for layer in range(facts.num_layers) for head in range(facts.num_heads)]
    epsilon = 1e-2
    values = {}
    for sign in (1, -1):
        sources = {
            layer: recorded[layer] + sign * epsilon * (passes.clean_heads[layer] - recorded[layer])
            for layer in recorded
        }
        patches = [HeadPatch(layer, (head,)) for layer, head in heads]
        outputs = inspector.patched_outputs(loaded, corrupted, patches, readout=_whole, sources=sources)[0]
        values[sign] = (outputs[:, -1, answer] - outputs[:, -1, wrong]).double()
    derivative = (values[1] - values[-1]) / (2 * epsilon)
    estimate = passes.heads.sum(1).reshape(-1)
    assert estimate.abs().max() > 1e-3  # something to compare
    torch.testing.assert_close(estimate, derivative, atol=2e-4 + 2e-3 * float(estimate.abs().max()), rtol=0)
    ld = float(passes.corrupted_logits[answer] - passes.corrupted_logits[wrong])
    assert ld == pytest.approx(float(values[1][0] + values[-1][0]) / 2, abs=1e-2)  # the corrupted run's LD


def test_the_mlp_estimate_is_the_derivative_of_exact_mlp_patching(tiny_models, inspector) -> None:
    """Each layer's whole MLP output patched to mlp_corrupted ± ε·(mlp_clean − mlp_corrupted), one row per layer:
    the central difference equals the MLP's attribution estimate."""
    loaded = tiny_models["llama"]
    clean, corrupted = inspector.encode(loaded, CLEAN), inspector.encode(loaded, CORRUPTED)
    answer, wrong = (loaded.tokenizer.convert_tokens_to_ids(w) for w in ("was", "tired"))
    passes = inspector.attribution_passes(loaded, clean, corrupted, _metric(answer, wrong), grad_drop=False)
    recorded: dict[int, torch.Tensor] = {}
    blocks = loaded.model.model.layers
    handles = [
        block.mlp.register_forward_hook(lambda m, a, out, i=i: recorded.__setitem__(i, out[0].detach().clone()))
        for i, block in enumerate(blocks)
    ]
    try:
        with torch.inference_mode():
            loaded.model(input_ids=corrupted.input_ids)
    finally:
        for handle in handles:
            handle.remove()
    epsilon, values = 1e-2, {}
    for sign in (1, -1):
        sources = {i: recorded[i] + sign * epsilon * (passes.clean_mlp[i] - recorded[i]) for i in recorded}
        logits = mlp_patched_logits(loaded, corrupted.input_ids, sources)
        values[sign] = (logits[:, answer] - logits[:, wrong]).double()
    derivative = (values[1] - values[-1]) / (2 * epsilon)
    estimate = passes.mlp.sum(1)
    assert estimate.abs().max() > 1e-3
    torch.testing.assert_close(estimate, derivative, atol=2e-4 + 2e-3 * float(estimate.abs().max()), rtol=0)


def test_grad_drop_of_a_last_layer_head_is_its_plain_estimate(tiny_models, inspector) -> None:
    """A last-layer head reaches the logits only through the last block: dropping that block's gradient zeroes its
    estimate, dropping any earlier one leaves it, so Σ_l |estimate_l| / (L − 1) = |estimate| (two layers)."""
    loaded = tiny_models["llama"]
    clean, corrupted = inspector.encode(loaded, CLEAN), inspector.encode(loaded, CORRUPTED)
    answer, wrong = (loaded.tokenizer.convert_tokens_to_ids(w) for w in ("was", "tired"))
    plain = inspector.attribution_passes(loaded, clean, corrupted, _metric(answer, wrong), grad_drop=False)
    dropped = inspector.attribution_passes(loaded, clean, corrupted, _metric(answer, wrong), grad_drop=True)
    last = loaded.facts.num_layers - 1
    assert dropped.rows == 1 + loaded.facts.num_layers
    torch.testing.assert_close(dropped.heads, plain.heads, atol=1e-6, rtol=1e-5)  # row 0 is the plain estimate
    assert dropped.grad_drop is not None
    torch.testing.assert_close(dropped.grad_drop[last], plain.heads[last].sum(0).abs(), atol=1e-6, rtol=1e-5)


def test_saturated_attention_hides_the_previous_token_head_and_verification_finds_it(inspector) -> None:
    """In the hand-built induction circuit L1H0's softmax is saturated (scores near 60), so the gradient through
    its keys is ~0 and the first-order estimate of L0H0 is far from its exact +100% (the failure AtP* names; here
    its LayerNorms are far from linear over the change too, so the plain estimate is shown, ``saturation_fix`` off).
    patch_heads never reports the estimate alone: L0H0 is patched exactly, with the estimate beside it."""
    register_model("circuit-attribution", induction_circuit(), circuit_tokenizer())
    from agent_tools.tools import get_tool

    arguments = {
        "model": "circuit-attribution",
        "clean": "cat dog sun moon cat",
        "corrupted": "sun dog cat moon cat",
        "method": "attribution",
        "verify": 2,
        "detail": "full",
        "saturation_fix": False,
    }
    report = get_tool("patch_heads")(inspector, arguments)
    assert report.method == "attribution" and report.attribution is not None
    rows = {(h.layer, h.head): h for h in report.heads}
    assert rows[(1, 0)].restored == 1.0 and rows[(1, 0)].estimate == pytest.approx(0.97, abs=0.01)
    assert rows[(0, 0)].restored == 1.0 and rows[(0, 0)].estimate < 0  # exact beside a wrong-signed estimate
    check = report.attribution
    assert check.verified_top == 2 and check.verified_random == 2 and len(report.heads) == 4
    assert all(h.estimate is not None for h in report.heads)  # every row reported was patched exactly
    assert [(r.layer, r.attention_exact) for r in check.layers] == [(0, 1.0), (1, 1.0)]
    assert "only exact values reported" in report.summary
    # per position, the exact value beside the estimate: L1H0 acts at the last position only, to first order too
    induction = next(p for p in report.positions if (p.layer, p.head) == (1, 0))
    assert [x.restored for x in induction.positions] == [0.0] * 5 + [1.0]
    assert [x.estimate for x in induction.positions] == pytest.approx([0.0] * 5 + [0.97], abs=0.01)
    with_drop = get_tool("patch_heads")(inspector, {**arguments, "grad_drop": True})
    assert with_drop.attribution is not None and with_drop.attribution.grad_drop
    assert with_drop.attribution.verified_top == 3  # 2 by |estimate|, then 1 more by GradDrop's score


def test_a_model_without_float_embeddings_is_refused(inspector) -> None:
    model = induction_circuit()
    table = model.transformer.wte.weight.detach()
    model.transformer.wte.weight = torch.nn.Parameter((table * 100).round().to(torch.int8), requires_grad=False)
    loaded: LoadedModel = register_model("circuit-int8-embeddings", model, circuit_tokenizer())
    clean, corrupted = (
        inspector.encode(loaded, "cat dog sun moon cat"),
        inspector.encode(loaded, "sun dog cat moon cat"),
    )
    with pytest.raises(InvalidInputError, match=r"no floating-point embedding table \(quantized or missing\): use "):
        inspector.attribution_passes(loaded, clean, corrupted, _metric(5, 6), grad_drop=False)


def test_a_row_patching_heads_in_several_layers_equals_a_plain_forward(tiny_models, inspector) -> None:
    """``HeadPatch.also``: one batched row patches heads of two layers together (the random-set baseline); it
    equals a forward with those heads' outputs replaced by hooks, next to single-layer rows in the same batch."""
    from agent_tools.layout import output_projection

    loaded = tiny_models["llama"]
    clean, corrupted = inspector.encode(loaded, CLEAN), inspector.encode(loaded, CORRUPTED)
    sources = recorded_run(loaded, clean.input_ids).heads
    sets = [((0, 1), (1, 2)), ((0, 0), (0, 3), (1, 0)), ((1, 1),)]
    patches = [HeadPatch(0, (1,), also=((1, 2),)), HeadPatch(0, (0, 3), also=((1, 0),)), HeadPatch(1, (1,))]
    batched = inspector.patched_outputs(loaded, corrupted, patches, readout=_whole, sources=sources, prefix=2)[0]
    facts, width = loaded.facts, loaded.facts.head_dim
    for row, chosen in enumerate(sets):
        handles = []
        for layer in {layer for layer, _ in chosen}:
            heads = [h for l_, h in chosen if l_ == layer]
            projection = output_projection(loaded.model, layer, in_features=facts.num_heads * width)

            def hook(module, args, layer=layer, heads=heads):
                x = args[0].clone()
                for head in heads:
                    x[0, :, head * width : (head + 1) * width] = sources[layer][:, head].reshape(x.shape[1], width)
                return (x, *args[1:])

            handles.append(projection.register_forward_pre_hook(hook))
        try:
            with torch.inference_mode():
                expected = loaded.model(input_ids=corrupted.input_ids).logits[0, -1].float()
        finally:
            for handle in handles:
                handle.remove()
        torch.testing.assert_close(batched[row, -1], expected, atol=1e-5, rtol=1e-5)


def test_a_backward_over_the_budget_is_refused_before_it_runs(tiny_models) -> None:
    from agent_tools.errors import ResourceLimitError
    from agent_tools.tools import get_tool

    small = Inspector(memory_budget=1024)
    arguments = {"model": "tiny-llama", "clean": CLEAN, "corrupted": CORRUPTED, "method": "attribution"}
    with pytest.raises(ResourceLimitError, match=r"attribution patching's backward over 9 tokens × 1 rows .* use "):
        get_tool("patch_heads")(small, arguments)


# --- AtP*: the saturated-attention fix ------------------------------------------------------------------------------
ANCHOR = 100.0  # a constant ±ANCHOR pair in every residual: LayerNorm divides by (almost) the same σ everywhere


def _saturated_selector():
    """A two-layer, two-head GPT-2 built by hand where the answer is chosen by a saturated head's keys.

    Tokens (circuit tokenizer): S ∈ {cat, dog}, X = red, Y = blue, ? = sat; prompt ``<bos> S red blue sat``.
    Every residual vector has zero mean and the anchor pair (+100, −100), so each LayerNorm (weight σ_ref = 100/√8)
    is the identity to 1e-4 and linear in the changes below. Residual dims: 2 isBos, 3 isS, 4 S's sign (cat +1,
    dog −1; 10 balances it), 5 isX, 6 isY, 7 is?, 8 FLAG (11 balances), 9 OUT (12 balances), 15 balances the rest.

    * L0H0 (saturated, scores 30): red reads S, blue/?/S read <bos>; its value is S's sign, written to FLAG. So
      FLAG = +1 at red for cat, −1 for dog, 0 elsewhere.
    * L1H0 (saturated): ? reads with scores 40·FLAG at red and 20 at blue (0 elsewhere), so cat -> red, dog -> blue;
      its value is isX − isY, written to OUT; the unembedding gives logit(red) − logit(blue) = 4·OUT.
    * L0H1, L1H1, the MLPs: zero.

    Clean (cat) LD = +4, corrupted (dog) LD = −4. Patching L0H0's clean output restores FLAG, so L1H0 reads red:
    exactly 100% restored. Its gradient path runs through L1H0's softmax, saturated in the corrupted run (weight
    1 − 3e−20 on blue): plain attribution estimates ~0%. AtP* recomputes L1H0's pattern with the clean scores
    (red +40 instead of −40: Δs = 80 at red), ΔA = e_red − e_blue, g·ΔA·v = 4·(1 − (−1)) = 8 = the whole gap, all
    of it along L0H0's score change: 100%.
    """
    import math

    import transformers as tf

    config = tf.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config).eval()
    ids = {"<bos>": 0, "cat": 5, "dog": 6, "red": 10, "blue": 11, "sat": 7}  # circuit_tokenizer's ids
    score_l0, score_l1 = 30 * math.sqrt(8), 40 * math.sqrt(8)  # GPT-2 scales scores by 1/√head_dim = 1/√8
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for norm in [block.ln_1 for block in model.transformer.h] + [block.ln_2 for block in model.transformer.h]:
            norm.weight.fill_(ANCHOR / math.sqrt(8))
        model.transformer.ln_f.weight.fill_(ANCHOR / math.sqrt(8))
        model.transformer.wpe.weight[:, 0], model.transformer.wpe.weight[:, 1] = ANCHOR, -ANCHOR
        table = model.transformer.wte.weight
        codes = {"<bos>": {2: 1.0}, "cat": {3: 1.0, 4: 1.0, 10: -1.0}, "dog": {3: 1.0, 4: -1.0, 10: 1.0}}
        codes |= {"red": {5: 1.0}, "blue": {6: 1.0}, "sat": {7: 1.0}}
        for word, code in codes.items():
            for dim, value in code.items():
                table[ids[word], dim] = value
            table[ids[word], 15] = -sum(code.values())
        first, second = model.transformer.h[0].attn, model.transformer.h[1].attn
        q, k, v = 0, 16, 32  # c_attn's columns: queries, keys, values; head 0 is the first 8 of each
        first.c_attn.weight[5, q + 0] = score_l0  # red asks for S
        first.c_attn.weight[[3, 6, 7], q + 1] = score_l0  # S, blue and ? ask for <bos>
        first.c_attn.weight[3, k + 0] = first.c_attn.weight[2, k + 1] = 1.0
        first.c_attn.weight[4, v + 0] = 1.0
        first.c_proj.weight[0, 8], first.c_proj.weight[0, 11] = 1.0, -1.0
        second.c_attn.weight[7, q + 0] = second.c_attn.weight[7, q + 1] = score_l1
        second.c_attn.weight[8, k + 0], second.c_attn.weight[6, k + 1] = 1.0, 0.5
        second.c_attn.weight[5, v + 0], second.c_attn.weight[6, v + 0] = 1.0, -1.0
        second.c_proj.weight[0, 9], second.c_proj.weight[0, 12] = 1.0, -1.0
        model.lm_head.weight[ids["red"], 9], model.lm_head.weight[ids["blue"], 9] = 2.0, -2.0
    return model


SELECTOR_CLEAN, SELECTOR_CORRUPTED = "cat red blue sat", "dog red blue sat"


def test_saturated_softmax_hides_the_upstream_head_from_plain_attribution_and_atp_star_finds_it(inspector) -> None:
    loaded = register_model("saturated-selector", _saturated_selector(), circuit_tokenizer())
    clean, corrupted = inspector.encode(loaded, SELECTOR_CLEAN), inspector.encode(loaded, SELECTOR_CORRUPTED)
    red, blue = 10, 11
    metric = _metric(red, blue)
    plain = inspector.attribution_passes(loaded, clean, corrupted, metric, grad_drop=False, saturation_fix=False)
    fixed = inspector.attribution_passes(loaded, clean, corrupted, metric, grad_drop=False)
    ld = [float(p[red] - p[blue]) for p in (fixed.clean_logits, fixed.corrupted_logits)]
    assert ld == pytest.approx([4.0, -4.0], abs=1e-3)
    gap = ld[0] - ld[1]
    # plain AtP: L1H0 (its own output) 100%, L0H0 ~0 (its path runs through L1H0's saturated softmax)
    assert (plain.heads.sum(1) / gap).flatten().tolist() == pytest.approx([0.0, 0.0, 1.0, 0.0], abs=1e-3)
    assert plain.saturated is None
    # AtP*: L1H0's softmax is the saturated one; L0H0 now gets the whole pattern change: 100%, as exact patching
    assert fixed.saturated == {1: [0]}
    assert (fixed.heads.sum(1) / gap).flatten().tolist() == pytest.approx([1.0, 0.0, 1.0, 0.0], abs=1e-3)
    sources = fixed.clean_heads
    patches = [HeadPatch(0, (0,)), HeadPatch(1, (0,))]
    outputs = inspector.patched_outputs(loaded, corrupted, patches, readout=_whole, sources=sources)[0]
    exact = ((outputs[:, -1, red] - outputs[:, -1, blue]).double() - ld[1]) / gap
    assert exact.tolist() == pytest.approx([1.0, 1.0], abs=1e-3)


def test_patch_heads_names_the_saturated_head_and_verifies_what_atp_star_ranks(inspector) -> None:
    from agent_tools.tools import get_tool

    register_model("saturated-selector-tool", _saturated_selector(), circuit_tokenizer())
    arguments = {
        "model": "saturated-selector-tool",
        "clean": SELECTOR_CLEAN,
        "corrupted": SELECTOR_CORRUPTED,
        "answer": "red",
        "wrong": "blue",
        "method": "attribution",
        "verify": 2,
        "top_k": 2,
        "detail": "full",
    }
    report = get_tool("patch_heads")(inspector, arguments)
    check = report.attribution
    assert check is not None and check.saturated == ["1.0"]
    assert "AtP* recomputed the saturated softmax of L1H0" in report.summary
    top = {(h.layer, h.head): (h.restored, h.estimate) for h in report.top_heads}
    assert top == {(0, 0): pytest.approx((1.0, 1.0), abs=1e-3), (1, 0): pytest.approx((1.0, 1.0), abs=1e-3)}
    assert check.recall == 2 and check.k == 2
    plain = get_tool("patch_heads")(inspector, {**arguments, "saturation_fix": False})
    assert plain.attribution is not None and plain.attribution.saturated is None
    rows = {(h.layer, h.head): h for h in plain.heads}
    assert rows[(0, 0)].restored == pytest.approx(1.0, abs=1e-3)  # exact, whether or not it was a candidate
    assert abs(rows[(0, 0)].estimate) < 1e-3  # ... beside plain attribution's ~0


# --- the trace's causal check by attribution -----------------------------------------------------------------------
TRACE_TEXT = "cat sat on the mat because it was tired and the dog ran to the park"
TRACE_SEGMENTS = ["cat sat", "on the mat", "because it", "was tired", "and the dog", "ran to the park"]


def test_the_trace_ablates_the_top_three_estimates_and_one_random_segment_and_reports_only_exact_values(
    tiny_models, inspector
) -> None:
    """Six named segments: every one is estimated (one forward and one backward), the three largest |estimates|
    and one drawn from the rest are ablated exactly; the two others carry no causal number, a note names them,
    and each checked segment's exact Δ Σ log p (neutral replacement) equals a plain forward's, estimate beside it."""
    from agent_tools.segment_attribution import choose_segments
    from agent_tools.tools import get_tool
    from agent_tools.traced_prompt.evidence import neutral_token

    loaded = tiny_models["llama"]
    segments = [{"name": f"s{i}", "text": text} for i, text in enumerate(TRACE_SEGMENTS)]
    arguments = {"model": "tiny-llama", "prompt": TRACE_TEXT, "segments": segments, "detail": "full"}
    report = get_tool("trace_prompt_attention")(inspector, arguments)
    check = report.causal_attribution
    assert check is not None and check.estimated == 6 and len(check.checked) == 4
    assert [row.chosen for row in check.checked] == ["top", "top", "top", "random"]
    rows = {s.name: s for s in report.segments}
    checked = {row.segment for row in check.checked}
    assert {name for name, s in rows.items() if s.causal is not None} == checked
    assert sorted(check.unchecked) == sorted(f"s{i}" for i in range(6) if f"s{i}" not in checked)
    notes = [note for note in report.evidence_notes if "not ablated" in note]
    assert len(notes) == 1 and all(repr(name) in notes[0] for name in check.unchecked)
    # the choice is attribution's: the three largest |estimates| of the same estimate, computed here again
    ids = inspector.encode(loaded, TRACE_TEXT).input_ids[0].tolist()
    neutral = neutral_token(loaded, None)
    answer = [report.answer_evidence.token_ids[0]]
    positions = {s.name: list(s.positions) for s in report.segments}
    names = [f"s{i}" for i in range(6)]
    variants = [[neutral if p in positions[n] else t for p, t in enumerate(ids)] for n in names]
    choice = choose_segments(inspector, loaded, ids, answer, variants)
    assert [names[i] for i in choice.verified] == [row.segment for row in check.checked[:3]]
    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([ids, *variants])).logits[:, -1].float()
    logp = torch.log_softmax(logits, -1)[:, answer[0]]
    for row in check.checked:
        index = names.index(row.segment)
        assert row.exact == pytest.approx(float(logp[1 + index] - logp[0]), abs=1e-3)
        assert row.estimate == pytest.approx(choice.estimates[index], abs=1e-3)
        assert rows[row.segment].causal.answer_neutral == row.exact
    assert check.missed is not None and check.missed.chosen == "random"


def test_the_trace_falls_back_to_exact_ablation_when_the_estimate_cannot_run(tiny_models) -> None:
    """Over the gradient budget, or without float embeddings (quantized): every segment is ablated exactly and a
    note says why (the causal check itself never needs gradients); four or fewer segments never estimate."""
    from agent_tools.segment_attribution import choice_for_trace

    loaded = tiny_models["llama"]
    ids = loaded.tokenizer(TRACE_TEXT, add_special_tokens=False)["input_ids"]
    variants = [[0 if p == k else t for p, t in enumerate(ids)] for k in range(5)]
    notes: list[str] = []
    small = Inspector(memory_budget=1024)
    assert choice_for_trace(small, loaded, ids, ids[-1:], variants, notes) is None
    assert len(notes) == 1 and notes[0].startswith(
        "causal check: every segment ablated exactly (the attribution estimate could not run: a gradient pass over "
    )
    assert "of activations, over the budget of 1 KiB" in notes[0]
    assert choice_for_trace(Inspector(), loaded, ids, ids[-1:], variants[:4], notes) is None and len(notes) == 1
    model = induction_circuit()
    table = model.transformer.wte.weight.detach()
    model.transformer.wte.weight = torch.nn.Parameter((table * 100).round().to(torch.int8), requires_grad=False)
    quantized = register_model("circuit-int8-trace", model, circuit_tokenizer())
    words = quantized.tokenizer("cat dog sun moon cat", add_special_tokens=False)["input_ids"]
    neutral = [[4 if p == k else t for p, t in enumerate(words)] for k in range(5)]
    assert choice_for_trace(Inspector(), quantized, words, [5], neutral, notes) is None
    assert "no floating-point embedding table (quantized or missing)" in notes[1]


def test_segment_estimates_refuse_a_variant_of_another_length(tiny_models, inspector) -> None:
    from agent_tools.segment_attribution import choose_segments

    loaded = tiny_models["llama"]
    ids = loaded.tokenizer(TRACE_TEXT, add_special_tokens=False)["input_ids"]
    with pytest.raises(InvalidInputError, match=r"a neutral variant is 3 tokens, the prompt \d+: .* as many neutral"):
        choose_segments(inspector, loaded, ids, ids[-1:], [ids[:3]])


def test_a_head_is_saturated_when_the_first_order_misses_most_of_a_real_pattern_change() -> None:
    from agent_tools.analysis.attribution_patching import corrected_score_gradient, saturated_heads

    minimum = torch.finfo(torch.float32).min
    # head 0: two keys at scores (−40, 20) -> (40, 20): the pattern flips (ΔA = (1, −1), L1 mass 2), the first
    # order at a saturated softmax is ~0; head 1: scores (0, 0) -> (0.1, 0): a small, linear change (mass 0.05)
    scores = torch.tensor([[[-40.0, 20.0]], [[0.0, 0.0]]])
    target = torch.tensor([[[40.0, 20.0]], [[0.1, 0.0]]])
    assert saturated_heads(scores, target).tolist() == [True, False]
    # head 1 moved further, still linear: 0.5 -> ΔA = ±0.1225 (mass 0.245), first order ±0.125: not saturated
    assert not bool(saturated_heads(scores[1:], torch.tensor([[[0.5, 0.0]]]))[0])
    # a masked key (dtype minimum) takes no weight and no share of the change
    masked = torch.tensor([[[-40.0, 20.0, minimum]]])
    assert saturated_heads(masked, torch.tensor([[[40.0, 20.0, minimum]]])).tolist() == [True]
    # the corrected gradient times the whole change is g·ΔA: with g = (1, −1), ΔA ≈ (1, −1) -> 2
    gradient = torch.tensor([[[[1.0, -1.0]], [[1.0, -1.0]]]])
    fixed = corrected_score_gradient(scores[None], target[None], gradient, torch.tensor([True, False]))
    change = (target - scores)[None]
    assert float((fixed[0, 0] * change[0, 0]).sum()) == pytest.approx(2.0, abs=1e-6)
    plain = torch.softmax(scores[1], -1) * (gradient[0, 1] - (torch.softmax(scores[1], -1) * gradient[0, 1]).sum())
    torch.testing.assert_close(fixed[0, 1], plain)  # an uncorrected head keeps the plain softmax gradient
