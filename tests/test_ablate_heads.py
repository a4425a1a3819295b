"""Head ablation: pure metrics by hand, exact no-ops, whole-layer = no attention output, the model restored."""

from __future__ import annotations

import math

import pytest
import torch
from crafted import circuit_tokenizer, induction_circuit
from families import build_family, tiny_tokenizer

from agent_tools.analysis.ablation import cosine_change, masked_mean, replace_head_slices
from agent_tools.analysis.metrics import kl_divergence as next_token_kl
from agent_tools.analysis.metrics import next_token_losses as token_losses
from agent_tools.errors import InvalidInputError
from agent_tools.families import find_attention_modules
from agent_tools.inspector import Inspector
from agent_tools.intervene import heads_ablated, recorded_head_means
from agent_tools.layout import output_projection
from agent_tools.loading import register_model
from agent_tools.tools import get_tool
from agent_tools.tools.ablate_heads import parse_heads

TEXT = "the cat sat on the mat because it was tired"


# --- pure metrics -----------------------------------------------------------------------------------------------


def test_kl_loss_cosine_by_hand() -> None:
    clean = torch.tensor([[0.0, 0.0]])  # p = (1/2, 1/2)
    ablated = torch.tensor([[math.log(3.0), 0.0]])  # q = (3/4, 1/4)
    assert next_token_kl(clean, ablated).item() == pytest.approx(0.5 * math.log(4 / 3))
    assert next_token_kl(clean, clean).item() == 0.0
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]]))
    losses = token_losses(logits, torch.tensor([[0, 1, 2]]))
    assert losses[0].tolist() == pytest.approx([math.log(4), -math.log(0.8)])
    assert cosine_change(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])).item() == pytest.approx(1.0)
    assert cosine_change(torch.tensor([1.0, 1.0]), torch.tensor([2.0, 2.0])).item() == pytest.approx(0.0, abs=1e-12)


def test_replace_head_slices_is_pure_and_exact() -> None:
    hidden = torch.arange(12.0).reshape(1, 2, 6)  # (B, T, H·D) with H = 3, D = 2
    zeroed = replace_head_slices(hidden, [1], 2)
    assert zeroed.tolist() == [[[0, 1, 0, 0, 4, 5], [6, 7, 0, 0, 10, 11]]]
    means = torch.tensor([[-1.0, -1.0], [-2.0, -3.0], [-4.0, -4.0]])  # (H, D)
    meaned = replace_head_slices(hidden, [0, 2], 2, means)
    assert meaned.tolist() == [[[-1, -1, 2, 3, -4, -4], [-1, -1, 8, 9, -4, -4]]]
    assert hidden.tolist() == torch.arange(12.0).reshape(1, 2, 6).tolist()  # input untouched
    mask = torch.tensor([[1, 0]])
    assert masked_mean(hidden, mask).tolist() == [0, 1, 2, 3, 4, 5]
    assert masked_mean(hidden).tolist() == [3, 4, 5, 6, 7, 8]


def test_parse_heads_forms_and_errors() -> None:
    assert parse_heads(["3.0", "L2H5", {"layer": 1, "head": 1}, " 0:2 "], 4, 6) == [(3, 0), (2, 5), (1, 1), (0, 2)]
    assert parse_heads(["2.*", "0.1"], 4, 3) == [(2, 0), (2, 1), (2, 2), (0, 1)]
    with pytest.raises(InvalidInputError, match=r"heads\[0\] layer 4 out of range 0\.\.3"):
        parse_heads(["4.0"], 4, 6)
    with pytest.raises(InvalidInputError, match=r"heads\[1\] head 6 out of range 0\.\.5"):
        parse_heads(["0.0", "0.6"], 4, 6)
    with pytest.raises(InvalidInputError, match=r"out of range 0\.\.3"):
        parse_heads(["-1.0"], 4, 6)
    with pytest.raises(InvalidInputError, match=r'write "L\.H"'):
        parse_heads(["head three"], 4, 6)
    with pytest.raises(InvalidInputError, match=r"1\.1 more than once"):
        parse_heads(["1.1", {"layer": 1, "head": 1}], 4, 6)
    with pytest.raises(InvalidInputError, match=r"1\.0 more than once"):
        parse_heads(["1.*", "1.0"], 4, 6)
    with pytest.raises(InvalidInputError, match=r"heads\[0\] layer 9 out of range 0\.\.3"):
        parse_heads(["9.*"], 4, 6)


# --- interventions on tiny models -------------------------------------------------------------------------------


def _ids() -> torch.Tensor:
    return torch.tensor([[0, 6, 8, 10, 11, 6, 12, 13, 14, 15, 16]])


def _output(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


class ZeroAttentionOutput:
    """Reference: a forward hook that replaces the attention module's output (or a constant) — no head slicing."""

    def __init__(self, module: torch.nn.Module, fill: torch.Tensor | None = None) -> None:
        self.handle = module.register_forward_hook(self.hook)
        self.fill = fill

    def hook(self, module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        replaced = torch.zeros_like(first) if self.fill is None else self.fill.expand_as(first).clone()
        return (replaced, *output[1:]) if isinstance(output, tuple) else replaced


@pytest.mark.parametrize("family", ["llama", "bert", "gpt2", "gpt_neox", "opt", "phi3"])
def test_ablating_every_head_of_a_layer_removes_the_attention_output(family: str) -> None:
    model = build_family(family)
    config = model.config
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    ids = _ids()
    with heads_ablated(model, {1: list(range(heads))}, num_heads=heads, head_dim=head_dim):
        ablated = _output(model, ids)
    attention = find_attention_modules(model)[1]
    projection = output_projection(model, 1)
    bias = getattr(projection, "bias", None)
    # BERT's projection sits outside the self-attention module, so zeroing the module's output leaves dense(0) =
    # bias, exactly what head ablation leaves; elsewhere the projection is inside and its bias survives ablation.
    inside = any(child is projection for child in attention.children())
    fill = bias.detach() if inside and bias is not None else None
    reference = ZeroAttentionOutput(attention, fill)
    try:
        removed = _output(model, ids)
    finally:
        reference.handle.remove()
    assert torch.allclose(ablated, removed, atol=1e-6), (ablated - removed).abs().max()
    assert not torch.allclose(ablated, _output(model, ids), atol=1e-4)  # and it did change the output


def test_mean_ablation_sets_the_slice_to_the_recorded_mean_and_unhooks() -> None:
    model = build_family("llama")
    ids = _ids()
    with recorded_head_means(model, [0], num_heads=4, head_dim=8) as means:
        clean = _output(model, ids)
    assert means[0].shape == (4, 8)
    projection = output_projection(model, 0)
    recorded: list[torch.Tensor] = []
    with heads_ablated(model, {0: [2]}, num_heads=4, head_dim=8, method="mean", means=means):
        # registered after the ablation hook, so it sees what the projection receives
        handle = projection.register_forward_pre_hook(lambda m, args: recorded.append(args[0].clone()))
        try:
            _output(model, ids)
        finally:
            handle.remove()
    slice_ = recorded[0][0, :, 16:24]  # head 2's slice at every position = its mean over the clean positions
    assert torch.allclose(slice_, means[0][2].expand_as(slice_))
    assert torch.equal(_output(model, ids), clean)


@pytest.fixture(scope="module")
def zero_slice_model() -> str:
    """tiny llama whose layer-1 head 2 has an all-zero output-projection slice: it writes nothing."""
    model = build_family("llama", seed=3)
    with torch.no_grad():
        output_projection(model, 1).weight[:, 16:24] = 0
    register_model("tiny-llama-silent-head", model, tiny_tokenizer())
    return "tiny-llama-silent-head"


def test_a_head_with_a_zero_output_slice_changes_nothing(zero_slice_model, inspector: Inspector) -> None:
    for method in ("zero", "mean"):
        report = get_tool("ablate_heads")(
            inspector, {"model": zero_slice_model, "text": TEXT, "heads": ["1.2"], "method": method}
        )
        assert report.kl_last_position == 0 and report.kl_mean == 0 and report.loss_change == 0
        assert report.top_token_changed is False and report.top_token_clean == report.top_token_ablated
        assert report.measure == "next_token" and report.heads == ["1.2"]


def test_tool_restores_the_model_exactly(tiny_models, inspector: Inspector) -> None:
    model = tiny_models["llama"].model
    ids = _ids()
    before = _output(model, ids)
    report = get_tool("ablate_heads")(
        inspector, {"model": "tiny-llama", "text": TEXT, "heads": ["0.0", {"layer": 1, "head": 3}], "method": "mean"}
    )
    assert report.kl_mean is not None and report.kl_mean > 0
    assert report.loss_clean is not None and report.loss_ablated is not None
    assert report.loss_change == pytest.approx(report.loss_ablated - report.loss_clean, abs=1e-3)
    assert report.top_token_clean and report.top_token_ablated and len(report.largest_effects) == 5
    with pytest.raises(InvalidInputError, match=r"out of range 0\.\.1"):
        get_tool("ablate_heads")(inspector, {"model": "tiny-llama", "text": TEXT, "heads": ["2.0"]})
    with pytest.raises(InvalidInputError, match="heads"):
        get_tool("ablate_heads")(inspector, {"model": "tiny-llama", "text": TEXT, "heads": []})
    after = _output(model, ids)
    assert torch.equal(before, after)
    for layer in range(2):
        assert not output_projection(model, layer)._forward_pre_hooks
    assert model.config._attn_implementation == "eager"  # ablation never switched implementations


def test_encoder_reports_the_pooled_embedding_change(tiny_models, inspector: Inspector) -> None:
    # zero-ablation: tiny BERT's random heads attend almost uniformly in both directions, so each head writes about
    # the same vector at every position and mean-ablation changes next to nothing
    arguments = {"model": "tiny-bert", "text": TEXT, "heads": ["0.1", "1.0"], "method": "zero"}
    report = get_tool("ablate_heads")(inspector, arguments)
    assert report.measure == "embedding" and report.kl_mean is None
    assert report.baseline is not None and report.baseline.draws == 8 and "random sets of 2 heads" in report.summary
    assert report.pooled_cosine_change is not None and report.pooled_cosine_change > 0
    assert report.mean_token_cosine_change is not None and report.mean_token_cosine_change > 0


@pytest.mark.real_model
def test_default_model_ablation(smol, inspector: Inspector) -> None:
    text = "The cat sat on the mat because it was tired. The cat sat on the"
    before = _output(smol.model, torch.tensor([[1, 2, 3]]))
    report = get_tool("ablate_heads")(inspector, {"text": text, "heads": ["18.6", "17.4", "17.3"]})
    assert report.kl_mean is not None and report.kl_mean > 0 and report.loss_change is not None
    assert torch.equal(before, _output(smol.model, torch.tensor([[1, 2, 3]])))
    assert smol.model.config._attn_implementation == "sdpa"


# --- direct logit attribution ------------------------------------------------------------------------------------


def test_direct_logit_attribution_on_the_known_circuit(inspector: Inspector) -> None:
    register_model("circuit-dla", induction_circuit(), circuit_tokenizer())
    report = get_tool("ablate_heads")(
        inspector, {"model": "circuit-dla", "text": "cat dog sun moon cat", "heads": ["1.0"]}
    )
    dla = report.direct_logit_attribution
    assert dla is not None and dla.token == "dog" and dla.final_norm == "layer_norm"
    # only the induction head writes into the subspace the unembedding reads: it alone is the logit
    assert dla.top_heads[0].layer == 1 and dla.top_heads[0].head == 0
    assert dla.top_heads[0].logit == pytest.approx(dla.logit, abs=1e-4)
    assert all(h.logit == pytest.approx(0.0, abs=1e-6) for h in dla.top_heads[1:])
    assert dla.heads_total == pytest.approx(dla.logit, abs=1e-4) and dla.layers[0] == pytest.approx(0.0, abs=1e-6)
    assert [(h.layer, h.head) for h in dla.ablated] == [(1, 0)] and "frozen" in report.summary
    # removing it breaks the copy: the clean answer is no longer the top token
    assert report.top_token_clean == "dog" and report.top_token_changed
    assert [c.tool for c in report.next_calls] == ["profile_heads"]


def test_direct_logit_attribution_target_and_bad_target(tiny_models, inspector: Inspector) -> None:
    args = {"model": "tiny-llama", "text": TEXT, "heads": ["0.1"], "target_token": "mat"}
    dla = get_tool("ablate_heads")(inspector, args).direct_logit_attribution
    assert dla is not None and dla.token == "mat" and dla.final_norm == "rms_norm"
    with pytest.raises(InvalidInputError, match=r"target_token 'the cat' is 2 tokens \(\['the', 'cat'\]\)"):
        get_tool("ablate_heads")(inspector, {**args, "target_token": "the cat"})
    encoder = get_tool("ablate_heads")(inspector, {"model": "tiny-bert", "text": TEXT, "heads": ["0.1"]})
    assert encoder.direct_logit_attribution is None


# --- sizing an effect against random heads, ties, resample --------------------------------------------------------


def test_baseline_statistics_by_hand() -> None:
    from agent_tools.analysis.ablation import EFFECT_FLOOR, compare_with_baseline, size_against
    from agent_tools.analysis.metrics import BASELINE_SIGMAS, Baseline, chance_margin

    def margin(baseline: Baseline) -> float:
        return chance_margin(baseline.spread, sds=BASELINE_SIGMAS, floor=EFFECT_FLOOR)

    base = Baseline((1.0, 2.0, 3.0, 4.0))
    assert base.mean == 2.5 and base.spread == pytest.approx(math.sqrt(5 / 3))  # Σ(x − 2.5)² = 5, n − 1 = 3
    assert margin(base) == pytest.approx(2 * math.sqrt(5 / 3))
    assert compare_with_baseline(10.0, base) == "raises" and compare_with_baseline(-10.0, base) == "lowers"
    assert compare_with_baseline(3.0, base) == "within" and compare_with_baseline(5.08, base) == "within"
    assert compare_with_baseline(5.09, base) == "raises"  # 2.5 + 2·1.29099 = 5.082
    zero = Baseline((0.0, 0.0, 0.0))
    assert zero.spread == 0.0 and margin(zero) == 1e-3  # the floor when random heads do exactly nothing
    assert compare_with_baseline(0.0011, zero) == "raises" and compare_with_baseline(0.0009, zero) == "within"
    # beyond chance AND beyond the floor from 0: less of a drop than random heads is not "raises"
    assert compare_with_baseline(-0.5, Baseline((-1.0, -1.0))) == "within"
    assert compare_with_baseline(0.0011, Baseline((-1.0, -1.0))) == "raises"
    assert size_against(0.5, Baseline((0.1, 0.1))) == "larger" and size_against(0.0, Baseline((0.1, 0.1))) == "smaller"
    assert compare_with_baseline(5.0, Baseline(())) == "within"


def test_draws_and_derangement() -> None:
    from agent_tools.analysis.ablation import derangement, draw_head_sets

    pool = [(0, 0), (0, 1), (1, 0)]
    assert draw_head_sets(pool, 2, 8) == [((0, 0), (0, 1)), ((0, 0), (1, 0)), ((0, 1), (1, 0))]  # every set
    assert draw_head_sets(pool, 4, 8) == []  # fewer heads than a draw needs
    big = [(layer, head) for layer in range(6) for head in range(4)]
    drawn = draw_head_sets(big, 2, 8, seed=3)
    assert len(drawn) == 8 and len(set(drawn)) == 8 and drawn == draw_head_sets(big, 2, 8, seed=3)
    assert drawn != draw_head_sets(big, 2, 8, seed=4)
    order = derangement(6, [0], seed=1)
    assert order is not None and order[0] == 0 and sorted(order) == list(range(6))
    assert all(order[p] != p for p in range(1, 6))
    assert derangement(2, [0]) is None and derangement(1, []) is None


def test_tie_margin() -> None:
    from agent_tools.analysis.ablation import TIE_MARGIN
    from agent_tools.analysis.attribution_patching import top_token_change

    def logits(*top: float) -> torch.Tensor:  # these probabilities, the rest spread over 10 less likely tokens
        return torch.tensor([*top, *[(1 - sum(top)) / 10] * 10], dtype=torch.float64).log()

    assert TIE_MARGIN == 0.02
    clean = logits(0.40, 0.20)  # ' He', '\n', others: ' He' on top
    tie = top_token_change(clean, logits(0.148, 0.151))  # the ' He' 0.148 vs '\n' 0.151
    assert (tie.kind, tie.before, tie.after) == ("tie", 0, 1)
    assert tie.p_after == pytest.approx(0.151) and tie.p_before == pytest.approx(0.148)
    assert top_token_change(clean, logits(0.10, 0.121)).kind == "flip"  # 0.021 apart
    assert top_token_change(clean, logits(0.10, 0.119)).kind == "tie"  # 0.019 apart
    assert top_token_change(clean, logits(0.30, 0.20)).kind == "unchanged"


def test_effect_is_sized_against_random_heads(tiny_models, inspector: Inspector) -> None:
    """The baseline's mean and sd equal the draws ablated one at a time (unbatched), and the words follow them."""
    from agent_tools.analysis.ablation import draw_head_sets
    from agent_tools.analysis.metrics import Baseline

    args = {"model": "tiny-llama", "text": TEXT, "heads": ["0.1", "1.2"], "baseline_draws": 5, "seed": 2}
    report = get_tool("ablate_heads")(inspector, args)
    assert report.method == "mean" and report.baseline is not None  # mean-ablation by default
    assert report.baseline.draws == 5 and report.baseline.heads_per_draw == 2
    loaded = inspector.model("tiny-llama")
    encoded = inspector.encode(loaded, TEXT)
    pool = [(la, he) for la in range(2) for he in range(4) if (la, he) not in {(0, 1), (1, 2)}]
    changes = []
    for drawn in draw_head_sets(pool, 2, 5, seed=2):
        effect = inspector.ablate(loaded, encoded.input_ids, None, list(drawn), method="mean")
        changes.append(
            float(
                token_losses(effect.ablated, encoded.input_ids).mean()
                - token_losses(effect.clean, encoded.input_ids).mean()
            )
        )
    hand = Baseline(tuple(changes))
    assert report.baseline.effect[0] == pytest.approx(hand.mean, abs=1e-5)
    assert report.baseline.effect[1] == pytest.approx(hand.spread, abs=1e-5)
    way = "raises" if (report.loss_change or 0) > 0 else "lowers"
    assert "Removing 0.1, 1.2 (mean-ablation" in report.summary and f"{way} the loss on the text by" in report.summary
    assert "5 random sets of 2 heads" in report.summary
    assert ("within chance" in report.summary) == (report.baseline.effect_direction == "within")
    zero = get_tool("ablate_heads")(inspector, {**args, "method": "zero"})
    assert "out-of-distribution" in zero.summary


def test_resample_and_bad_input(tiny_models, inspector: Inspector) -> None:
    base = {"model": "tiny-llama", "text": TEXT, "heads": ["1.0"]}
    shuffled = get_tool("ablate_heads")(inspector, {**base, "method": "resample"})
    assert shuffled.resample_source is not None and "seeded random order (seed 0)" in shuffled.resample_source
    assert "special tokens kept in place" in shuffled.resample_source and "resample-ablation" in shuffled.summary
    given = get_tool("ablate_heads")(
        inspector, {**base, "method": "resample", "resample_text": TEXT + " and the dog sat too"}
    )
    assert given.resample_source == "the first 11 tokens of resample_text"
    with pytest.raises(InvalidInputError, match=r"resample_text is 3 tokens; .* at least 11"):
        get_tool("ablate_heads")(inspector, {**base, "method": "resample", "resample_text": "the cat"})
    with pytest.raises(InvalidInputError, match="only with method 'resample'"):
        get_tool("ablate_heads")(inspector, {**base, "resample_text": TEXT})
    with pytest.raises(InvalidInputError, match="fewer than 2 tokens that could be shuffled"):
        get_tool("ablate_heads")(inspector, {**base, "text": "cat", "method": "resample"})
    with pytest.raises(InvalidInputError, match="'mean', 'resample' or 'zero'"):
        get_tool("ablate_heads")(inspector, {**base, "method": "half"})
    # a baseline needs as many other heads as were removed: 7 of 8 leave 1, so no baseline, said so
    most = get_tool("ablate_heads")(inspector, {**base, "heads": ["0.*", "1.0", "1.1", "1.2"]})
    assert most.baseline is None and any("no baseline: it needs 7 heads" in n for n in most.notes)
    assert "no random-head baseline" in most.summary


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_batched_rows_equal_one_ablation_at_a_time(tiny_models, inspector: Inspector, family: str) -> None:
    """Head sets over several layers, three methods, as rows of one batch joining at their first ablated layer:
    each row's effect equals its own clean + ablated pair (``Inspector.ablate``), and the model is restored."""
    from agent_tools.ablation_check import measure_head_sets, resample_source

    loaded = inspector.model(f"tiny-{family}")
    encoded = inspector.encode(loaded, TEXT)
    source = resample_source(inspector, loaded, encoded, None, seed=0)
    rows = [(((1, 2),), "mean"), (((0, 1), (1, 3)), "resample"), (((1, 0),), "zero"), (((0, 0), (0, 3)), "mean")]
    before = _output(loaded.model, _ids())
    measured = measure_head_sets(inspector, loaded, encoded, rows, source)
    for (heads, method), found in zip(rows, measured.effects, strict=True):
        alone = inspector.ablate(loaded, encoded.input_ids, None, list(heads), method=method, resample_ids=source.ids)
        if alone.language_model:
            change = (
                token_losses(alone.ablated, encoded.input_ids).mean()
                - token_losses(alone.clean, encoded.input_ids).mean()
            )
            assert found.loss_change == pytest.approx(float(change), abs=1e-5)
            assert found.kl_mean == pytest.approx(
                float(next_token_kl(alone.clean[0], alone.ablated[0]).mean()), abs=1e-6
            )
        else:
            pooled = cosine_change(alone.clean[0].mean(0).double(), alone.ablated[0].mean(0).double())
            assert found.cosine_change == pytest.approx(float(pooled), abs=1e-6)
    assert torch.equal(before, _output(loaded.model, _ids()))
    for layer in range(2):
        assert not output_projection(loaded.model, layer)._forward_pre_hooks


def test_stepped_readouts_equal_the_whole_block_and_stop_between_steps() -> None:
    """The ablation readouts run 256 positions at a time: the same numbers as the whole (B, T, V) block, and a
    cancelled call stops at the next step (a long text's block is tens of seconds of work)."""
    from agent_tools.ablation_check import stepped_kl, stepped_losses
    from agent_tools.errors import CallCancelledError
    from agent_tools.runner.readout import POSITIONS_PER_BLOCK
    from agent_tools.session import CallContext, call_scope

    generator = torch.Generator().manual_seed(0)
    length = 2 * POSITIONS_PER_BLOCK + 3  # three steps, the last of 3 positions
    logits = torch.randn(3, length, 11, generator=generator) * 4
    ids = torch.randint(0, 11, (1, length), generator=generator)
    whole = token_losses(logits, ids.expand(3, -1))  # (3, T-1)
    assert torch.allclose(stepped_losses(logits, ids), whole, rtol=0, atol=1e-12)
    assert torch.allclose(stepped_kl(logits[:1], logits), next_token_kl(logits[:1], logits), rtol=0, atol=1e-12)
    assert stepped_kl(logits[0], logits[1]).shape == (length,)

    context = CallContext()
    seen = []
    context.progress, context.progress_every = seen.append, 0.0  # one call per checkpoint
    with call_scope(context):
        stepped_kl(logits[:1], logits)
    assert len(seen) == 3  # a checkpoint before each step
    context.cancel("the test cancelled it")
    with call_scope(context), pytest.raises(CallCancelledError, match="the test cancelled it"):
        stepped_losses(logits, ids)
