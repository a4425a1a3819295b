"""The metrics glossary on hand-computed examples, and the streamed statistics against the glossary.

Every expected number below is worked out in the comment next to it (natural logs: ln 2 = 0.693147,
ln 3 = 1.098612, ln 4 = 1.386294).
"""

from __future__ import annotations

import math

import pytest
import torch
from reference import collapse_statistics
from torch import nn

from agent_tools.analysis.heads import SequenceLayout
from agent_tools.analysis.metrics import (
    Baseline,
    allowed_from_additive_mask,
    attention_entropy,
    chance_margin,
    chance_side,
    exceeds_baseline,
    first_token_share,
    js_divergence,
    kl_divergence,
    masked_softmax,
    max_weight,
    next_token_losses,
    normalised_entropy,
    normalised_from_entropy,
    received_attention,
    saturated,
    sink_key_mask,
    sink_row_fraction,
    threshold_sinks,
    visible_keys,
    without_sink,
)
from agent_tools.analysis.reconstruct import sink_softmax
from agent_tools.capture import LayerAttention
from agent_tools.consumers.grid import QuantisedMaps
from agent_tools.consumers.roles import role_scores

LN2, LN3, LN4 = math.log(2), math.log(3), math.log(4)

# One causal 4 × 4 head map, rows summing to 1, on which the four sink measures all differ:
#   row 0: [1.0, 0,   0,   0  ]  (reads only key 0)
#   row 1: [0.6, 0.4, 0,   0  ]  argmax 0
#   row 2: [0.2, 0.6, 0.2, 0  ]  argmax 1
#   row 3: [0.5, 0.1, 0.1, 0.3]  argmax 0
CAUSAL_MAP = torch.tensor(
    [
        [1.0, 0.0, 0.0, 0.0],
        [0.6, 0.4, 0.0, 0.0],
        [0.2, 0.6, 0.2, 0.0],
        [0.5, 0.1, 0.1, 0.3],
    ],
    dtype=torch.float64,
)
CAUSAL = torch.ones(4, 4, dtype=torch.bool).tril()


# --- entropy ------------------------------------------------------------------------------------------------


def test_entropy_of_hand_rows() -> None:
    rows = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.5, 0.25, 0.25]], dtype=torch.float64)
    # H([½, ½]) = ln 2; H(one-hot) = 0 (0·ln 0 = 0); H([½, ¼, ¼]) = ½ ln 2 + 2·¼ ln 4 = 1.5 ln 2 = 1.039721
    assert attention_entropy(rows).tolist() == pytest.approx([LN2, 0.0, 1.5 * LN2], abs=1e-12)


def test_normalised_entropy_divides_by_log_of_visible_keys() -> None:
    rows = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.5, 0.25, 0.25]], dtype=torch.float64)
    allowed = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    # [½, ½] over its 2 visible keys: ln 2 / ln 2 = 1; a row seeing one key: 0 (not 0/0);
    # [½, ¼, ¼] over 3 keys: 1.5 ln 2 / ln 3 = 0.946395
    assert visible_keys(allowed).tolist() == [2, 1, 3]
    assert normalised_entropy(rows, allowed).tolist() == pytest.approx([1.0, 0.0, 1.5 * LN2 / LN3], abs=1e-12)
    # without a mask every key counts: [½, ½, 0] over 3 keys is ln 2 / ln 3 = 0.630930
    assert float(normalised_entropy(rows)[0]) == pytest.approx(LN2 / LN3, abs=1e-12)
    # the same from an entropy already computed (what the streaming consumers hand in)
    given = normalised_from_entropy(torch.tensor([LN2, 0.3, LN4]), torch.tensor([2, 1, 4]))
    assert given.tolist() == pytest.approx([1.0, 0.0, 1.0], abs=1e-6)


def test_max_weight() -> None:
    # row [0.2, 0.7, 0.1]: largest weight 0.7 on key 1
    values, keys = max_weight(torch.tensor([[0.2, 0.7, 0.1]]))
    assert values.tolist() == pytest.approx([0.7]) and keys.tolist() == [1]


# --- softmax ------------------------------------------------------------------------------------------------


def test_masked_softmax_gives_hidden_keys_zero() -> None:
    logits = torch.tensor([[1.0, 5.0, 1.0]])
    allowed = torch.tensor([[True, False, True]])
    # key 1 hidden: softmax over the two equal logits left = [½, 0, ½], however large the hidden logit
    assert masked_softmax(logits, allowed)[0].tolist() == pytest.approx([0.5, 0.0, 0.5])
    # without a mask: e^1, e^5, e^1 over their sum
    expected = [math.e / (2 * math.e + math.e**5), math.e**5 / (2 * math.e + math.e**5)]
    assert masked_softmax(logits)[0, :2].tolist() == pytest.approx(expected)


def test_additive_mask_converts_to_the_bool_convention() -> None:
    minimum = torch.finfo(torch.float32).min
    additive = torch.tensor([[0.0, minimum, 0.0, -math.inf]])
    allowed = allowed_from_additive_mask(additive)
    assert allowed.tolist() == [[True, False, True, False]]
    # the additive form softmax(z + mask) and the bool form agree exactly (exp(z + min − max) is 0 too)
    logits = torch.tensor([[1.0, 5.0, 2.0, 3.0]])
    additive_form = torch.softmax(logits + additive, dim=-1)
    assert torch.equal(masked_softmax(logits, allowed), additive_form)


# --- divergences --------------------------------------------------------------------------------------------


def test_kl_divergence_direction_and_inputs() -> None:
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    q = torch.tensor([0.25, 0.75], dtype=torch.float64)
    # KL(p ‖ q) = ½ ln(½/¼) + ½ ln(½/¾) = ½ ln(4/3) = 0.143841
    # KL(q ‖ p) = ¼ ln(¼/½) + ¾ ln(¾/½) = −¼ ln 2 + ¾ ln 1.5 = 0.130812: the divergence is not symmetric
    assert float(kl_divergence(p.log(), q.log())) == pytest.approx(0.5 * math.log(4 / 3), abs=1e-12)
    assert float(kl_divergence(q.log(), p.log())) == pytest.approx(-0.25 * LN2 + 0.75 * math.log(1.5), abs=1e-12)
    # logits, not probabilities: adding a constant to the logits changes nothing
    assert float(kl_divergence(p.log() + 3.0, q.log() - 1.0)) == pytest.approx(0.5 * math.log(4 / 3), abs=1e-12)
    assert float(kl_divergence(p.log(), p.log())) == 0.0


def test_js_divergence_bounds_and_value() -> None:
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.3, 0.7]])
    q = torch.tensor([[0.0, 1.0], [0.25, 0.75], [0.3, 0.7]])
    # disjoint rows: ln 2 (the maximum); equal rows: 0;
    # [½, ½] vs [¼, ¾]: m = [⅜, ⅝], KL(p‖m) = ½ ln(4/3) + ½ ln(0.8) = 0.032269,
    # KL(q‖m) = ¼ ln(2/3) + ¾ ln(1.2) = 0.035375, JS = ½ (0.032269 + 0.035375) = 0.033822
    assert js_divergence(p, q).tolist() == pytest.approx([LN2, 0.033822, 0.0], abs=1e-6)
    assert torch.equal(js_divergence(p, q), js_divergence(q, p))  # symmetric


def test_next_token_losses() -> None:
    # position 0 logits [ln 3, 0] -> p = [¾, ¼]; the next token is 1: loss −ln ¼ = ln 4.
    # position 1 logits [0, 0] -> p = [½, ½]; next token 0: loss ln 2. The last position predicts nothing.
    logits = torch.tensor([[[math.log(3), 0.0], [0.0, 0.0], [5.0, 0.0]]])
    losses = next_token_losses(logits, torch.tensor([[0, 1, 0]]))
    assert losses[0].tolist() == pytest.approx([LN4, LN2], abs=1e-6)  # float32 logits


# --- the four sink measures on one map ----------------------------------------------------------------------


def test_first_token_share_counts_every_row() -> None:
    # mean of column 0 over all four rows: (1 + 0.6 + 0.2 + 0.5) / 4 = 0.575 (row 0 adds its forced 1)
    assert float(first_token_share(CAUSAL_MAP)) == pytest.approx(0.575, abs=1e-12)


def test_the_first_token_role_leaves_out_the_early_rows() -> None:
    """The first_token role is its kernel in the registry scored like every role: no second formula."""
    # skip = 2 (a 4-token text): rows 2 and 3 only: (0.2 + 0.5) / 2 = 0.35
    layout = SequenceLayout.for_text(["a", "b", "c", "d"], [False] * 4, causal=True)
    assert layout.skip_queries == 2
    roles = role_scores(CAUSAL_MAP[None].float(), layout, ["first_token"], CAUSAL)
    assert float(roles["first_token"][0]) == pytest.approx(0.35, abs=1e-6)
    # skip = 0 still leaves out row 0 (i ≥ max(1, skip)): (0.6 + 0.2 + 0.5) / 3 = 0.433333
    unskipped = SequenceLayout.for_text(["a", "b", "c", "d"], [False] * 4, causal=True, skip_queries=0)
    roles = role_scores(CAUSAL_MAP[None].float(), unskipped, ["first_token"], CAUSAL)
    assert float(roles["first_token"][0]) == pytest.approx(1.3 / 3, abs=1e-6)


def test_sink_row_fraction_counts_argmax_rows() -> None:
    # rows that can choose: 1, 2, 3 (row 0 sees one key); argmax 0, 1, 0 -> 2 of 3 on the first token
    sinks = sink_key_mask([False, False, False, False])
    assert sinks.tolist() == [True, False, False, False]  # the first token is always a sink key
    assert float(sink_row_fraction(CAUSAL_MAP, sinks, CAUSAL)) == pytest.approx(2 / 3, abs=1e-12)
    # with token 1 special ([SEP], BOS …) row 2's argmax is a sink too: 3 of 3
    special = sink_key_mask([False, True, False, False])
    assert float(sink_row_fraction(CAUSAL_MAP, special, CAUSAL)) == pytest.approx(1.0, abs=1e-12)


def test_threshold_sinks_from_received_attention() -> None:
    received = received_attention(CAUSAL_MAP[None], CAUSAL, torch.arange(4))  # one head
    # weight received from the *other* queries: key 0 <- rows 1, 2, 3: 0.6 + 0.2 + 0.5 = 1.3;
    # key 1 <- rows 2, 3: 0.6 + 0.1 = 0.7; key 2 <- row 3: 0.1; key 3: nothing
    assert received.total.tolist() == pytest.approx([1.3, 0.7, 0.1, 0.0], abs=1e-12)
    assert received.count.tolist() == [3, 2, 1, 0]
    # uniform rows over 2, 3, 4 keys: key 0 gets 1/2 + 1/3 + 1/4 = 13/12, key 1 1/3 + 1/4 = 7/12, key 2 1/4
    assert received.uniform.tolist() == pytest.approx([13 / 12, 7 / 12, 0.25, 0.0], abs=1e-6)  # float32
    # mean shares 1.3/3 = 0.433, 0.7/2 = 0.35, 0.1 (a key nobody reads: 0); uniform 13/36 = 0.361, 7/24 = 0.292, 0.25.
    assert received.mean_share().tolist() == pytest.approx([1.3 / 3, 0.35, 0.1, 0.0], abs=1e-6)
    # threshold 0.3, ratio 1.1: key 0 (0.433 ≥ 0.397) and key 1 (0.35 ≥ 0.321) are sinks
    assert threshold_sinks(received, threshold=0.3, min_readers=2, min_ratio=1.1, always=()) == [0, 1]
    assert threshold_sinks(received, threshold=0.4, min_readers=2, min_ratio=1.1, always=()) == [0]
    # the default needs 4 readers: no key of a 4-token text qualifies, only the always-listed first token
    assert threshold_sinks(received, threshold=0.3, always=()) == []
    assert threshold_sinks(received, threshold=0.3) == [0]


def test_the_streamed_sink_numbers_are_the_glossary_ones() -> None:
    """diagnose_collapse's sink_fraction and profile_heads' first_token role equal the glossary variants."""
    scores = CAUSAL_MAP.clamp_min(1e-9).log()[None]  # (1, 4, 4) any scores will do for these fields
    sinks = sink_key_mask([False] * 4)
    (collapse,) = collapse_statistics(CAUSAL_MAP[None], scores, CAUSAL, sinks)
    assert collapse.sink_fraction == pytest.approx(float(sink_row_fraction(CAUSAL_MAP, sinks, CAUSAL)))  # 2/3
    layout = SequenceLayout.for_text(["a", "b", "c", "d"], [False] * 4, causal=True)  # skip = 2
    roles = role_scores(CAUSAL_MAP[None].float(), layout, ["first_token", "broad"], CAUSAL)
    assert float(roles["first_token"][0]) == pytest.approx(0.35, abs=1e-6)
    # broad = mean normalised entropy over rows 2, 3 (skip 2): (0.950271 / ln 3 + 1.168282 / ln 4) / 2
    expected_broad = float(normalised_entropy(CAUSAL_MAP, CAUSAL)[2:].mean())
    assert float(roles["broad"][0]) == pytest.approx(expected_broad, abs=1e-6)
    assert float(collapse.mean_normalised_entropy) == pytest.approx(
        float(normalised_entropy(CAUSAL_MAP, CAUSAL)[1:].mean()), abs=1e-9
    )


# --- head roles: every role's formula on the 4 x 4 map, by hand -------------------------------------------------


def test_every_role_score_by_hand() -> None:
    map64 = CAUSAL_MAP[None].float()  # (1, 4, 4)
    text = SequenceLayout.for_text(["a", ",", "b", "c"], [False] * 4, causal=True)  # skip 2: rows 2 and 3
    roles = role_scores(map64, text, ["previous_token", "self", "first_token", "local", "punctuation"], CAUSAL)
    got = {role: float(values[0]) for role, values in roles.items()}
    assert got == pytest.approx(
        {
            "previous_token": (0.6 + 0.1) / 2,  # A[2, 1], A[3, 2]
            "self": (0.2 + 0.3) / 2,  # A[2, 2], A[3, 3]
            "first_token": (0.2 + 0.5) / 2,  # A[2, 0], A[3, 0]
            "local": 0.1,  # keys 2..4 away, not key 0: row 2 has none (not scored), row 3 reads key 1: 0.1
            "punctuation": (0.6 + 0.1) / 2,  # the "," at key 1, read by rows 2 and 3
        },
        abs=1e-6,
    )
    # a probe of N = 2 from position 0: the second copy is rows 2, 3; induction reads i - N + 1 = i - 1,
    # duplicate_token i - N = i - 2
    probe = SequenceLayout.for_probe(4, start=0, repeat_length=2, causal=True)
    roles = role_scores(map64, probe, ["induction", "duplicate_token"], CAUSAL)
    assert float(roles["induction"][0]) == pytest.approx((0.6 + 0.1) / 2, abs=1e-6)
    assert float(roles["duplicate_token"][0]) == pytest.approx((0.2 + 0.1) / 2, abs=1e-6)


def test_random_baseline_and_when_an_effect_exceeds_it() -> None:
    # mean 0.05; deviations -0.05, 0.05, -0.15, 0.15: Σ dev² = 0.0025 + 0.0025 + 0.0225 + 0.0225 = 0.05;
    # SAMPLE variance 0.05 / (4 − 1) = 0.016667, std 0.129099 (the population std, 0.05 / 4 -> 0.111803, is smaller)
    baseline = Baseline((0.0, 0.1, -0.1, 0.2))
    assert (baseline.mean, baseline.spread, baseline.draws) == pytest.approx((0.05, math.sqrt(0.05 / 3), 4))
    # the bar: 0.05 + 2 × 0.129099 = 0.308199 (with the population std it was 0.273607: 0.3 passed it)
    assert exceeds_baseline(0.31, baseline, floor=0.01) and not exceeds_baseline(0.3, baseline, floor=0.01)
    assert not exceeds_baseline(-1.0, baseline, floor=0.01)  # lowering the loss is not "needed"
    assert baseline.side(-0.21, sds=2.0, floor=0.01) == -1 and baseline.side(-0.2, sds=2.0, floor=0.01) == 0
    two = Baseline((1.0, 2.0))  # mean 1.5, Σ dev² = 0.5, sample sd sqrt(0.5 / 1) = 0.707107 (population: 0.5)
    assert two.spread == pytest.approx(math.sqrt(0.5)) and two.side(2.9, sds=2.0, floor=0.01) == 0  # bar 2.914214
    zeros = Baseline((0.0, 0.0, 0.0))  # no spread: the floor is the bar
    assert not exceeds_baseline(0.005, zeros, floor=0.01) and exceeds_baseline(0.02, zeros, floor=0.01)
    one = Baseline((0.0,))  # one draw: no spread, and no baseline
    assert (one.mean, one.spread, one.draws) == (0.0, 0.0, 1) and not exceeds_baseline(5.0, one, floor=0.01)
    none = Baseline(())  # no draws: a NaN mean, within chance whatever the effect
    assert none.draws == 0 and math.isnan(none.mean) and none.spread == 0.0
    assert none.side(5.0, sds=2.0, floor=0.01) == 0 and not exceeds_baseline(5.0, none, floor=0.01)


def test_one_beyond_chance_rule_with_each_callers_parameters() -> None:
    # margin = max(k·sd, floor): 2 × 0.1 = 0.2 beats the floor 0.05; 3 × 0.01 = 0.03 loses to it
    assert chance_margin(0.1, sds=2.0, floor=0.05) == pytest.approx(0.2)
    assert chance_margin(0.01, sds=3.0, floor=0.05) == 0.05
    # mean 1.0, sd 0.1, k = 2: above 1.2 counts (+1), below 0.8 counts (−1), between is within (0)
    assert [chance_side(v, 1.0, 0.1, sds=2.0, floor=0.05) for v in (1.21, 1.19, 0.81, 0.79)] == [1, 0, 0, -1]
    # attribution patching's rule (k = 3, floor 0.05): sd 0 leaves the floor, on either side
    assert [chance_side(v, 0.0, 0.0, sds=3.0, floor=0.05) for v in (0.06, 0.04, -0.06)] == [1, 0, -1]
    assert chance_side(math.nan, 0.0, 0.1, sds=2.0, floor=0.0) == 0  # no number, no verdict


def test_a_learned_sink_column_takes_what_the_keys_do_not() -> None:
    # real-key weights 0.2 + 0.4 leave 0.4 to the sink column; a sum a rounding above 1 gives 0, not −1e-7
    """The sink column share is measured where the softmax runs (reconstruct's sink_softmax, capture's
    LayerAttention.sink_share, which test_family_coverage checks the same way): no formula of its own."""
    # GPT-OSS's eager form: exp logits (1, 2) and sink exp 2 -> real keys 1/5 = 0.2, 2/5 = 0.4, sink 0.4
    logits = torch.tensor([[0.0, math.log(2.0)]])
    real = sink_softmax(logits, None, math.log(2.0))
    assert real.tolist() == [pytest.approx([0.2, 0.4], abs=1e-6)]
    assert float(1 - real.sum()) == pytest.approx(0.4, abs=1e-6)
    # a key that may not be read gets exactly 0, and the sink takes its part: exp logits (1) and sink 1 -> 0.5, 0.5
    hidden = sink_softmax(logits, torch.tensor([[True, False]]), 0.0)
    assert hidden.tolist() == [[pytest.approx(0.5, abs=1e-6), 0.0]]


def test_shares_without_the_sink_segment() -> None:
    shares = torch.tensor([[0.5, 0.3, 0.2], [0.0, 0.5, 0.5]])
    assert torch.allclose(without_sink(shares, 0), torch.tensor([[0.0, 0.6, 0.4], [0.0, 0.5, 0.5]]))
    assert torch.equal(without_sink(shares, None), shares)


def test_saturated_rows_reach_the_threshold() -> None:
    tops = torch.tensor([0.5, 0.98999, 0.99, 1.0])
    assert saturated(tops).tolist() == [False, False, True, True]  # SATURATION = 0.99, at or above
    assert saturated(tops, 0.5).tolist() == [True, True, True, True]


# --- the analyze grid ----------------------------------------------------------------------------------------


def _layer(weights: torch.Tensor, *, start: int) -> LayerAttention:
    """A captured chunk of rows ``start ..`` of a 4-token causal map: weights (1, H, q, 4)."""
    heads, rows = weights.shape[1], weights.shape[2]
    mask = torch.zeros(1, 1, rows, 4).masked_fill(~CAUSAL[start : start + rows][None, None], torch.finfo().min)
    empty = torch.zeros(1, heads, 4, 2)
    return LayerAttention(
        layer=0, query=torch.zeros(1, heads, rows, 2), key=empty, value=empty, mask=mask, weights=weights,
        scaling=1.0, softcap=None, kv_groups=1, query_start=start, query_length=4, module=nn.Identity(),
    )  # fmt: skip


def test_grid_statistics_are_the_glossary_functions() -> None:
    """The per-head numbers the README and the HTML report show, on a constructed map, chunked and whole."""
    uniform = CAUSAL.double() / CAUSAL.sum(-1, keepdim=True)  # row i: 1/(i+1) on each visible key
    maps = torch.stack([CAUSAL_MAP, uniform]).float()[None]  # (1, 2, 4, 4)
    whole, chunked = QuantisedMaps(1, 2, 4), QuantisedMaps(1, 2, 4)
    whole.on_layer(_layer(maps, start=0))
    chunked.on_layer(_layer(maps[:, :, :2], start=0))
    chunked.on_layer(_layer(maps[:, :, 2:], start=2))
    for grid in (whole, chunked):
        # head 0: row entropies 0, 0.673012, 0.950271, 1.168282 -> mean 0.697891 nats
        assert grid.entropy[0].tolist() == pytest.approx(attention_entropy(maps[0]).mean(-1).tolist(), abs=1e-6)
        assert float(grid.entropy[0, 0]) == pytest.approx(0.697891, abs=1e-5)
        # normalised: 0 (one key), 0.673012/ln 2, 0.950271/ln 3, 1.168282/ln 4 -> mean 0.669665; uniform head: 0.75
        normalised = normalised_entropy(maps[0], CAUSAL).mean(-1)
        assert grid.normalised_entropy[0].tolist() == pytest.approx(normalised.tolist(), abs=1e-6)
        assert grid.normalised_entropy[0].tolist() == pytest.approx([0.669665, 0.75], abs=1e-5)
        # first-token share over every row: 0.575; uniform head: (1 + 1/2 + 1/3 + 1/4) / 4 = 0.520833
        assert grid.first_token_share[0].tolist() == pytest.approx(first_token_share(maps[0]).tolist(), abs=1e-6)
        assert grid.first_token_share[0].tolist() == pytest.approx([0.575, 25 / 48], abs=1e-6)
        # mean max weight: (1 + 0.6 + 0.6 + 0.5) / 4 = 0.675; uniform head: the same 0.520833
        assert grid.max_weight[0].tolist() == pytest.approx(max_weight(maps[0])[0].mean(-1).tolist(), abs=1e-6)
        assert grid.max_weight[0].tolist() == pytest.approx([0.675, 25 / 48], abs=1e-6)
    assert whole.maps is not None and int(whole.maps[0, 0, 3, 0]) == round(0.5 * 255)
