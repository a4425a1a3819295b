"""plan_kv_cache: exact short-cache masking, the joining batch, the greedy plan, a known-answer circuit, bad input."""

from __future__ import annotations

import pytest
import torch
from crafted import INDUCTION_HEAD, circuit_tokenizer, induction_circuit
from families import build_family

from agent_tools.analysis.long_context import greedy_plan, kv_cache_bytes, short_cache_saving, verified_greedy
from agent_tools.capture import attention_implementation
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel, register_model
from agent_tools.restricted_attention import short_cache_allowed
from agent_tools.runner.short_cache import restricted_pass, unit_losses
from agent_tools.tools import get_tool

# ten words three times: past the first ten, only the induction head (reading 10 tokens back) predicts the next
CIRCUIT_TEXT = " ".join(["cat sat on mat red blue green one two three"] * 3)


def test_short_cache_allowed_by_hand() -> None:
    allowed = short_cache_allowed(torch.tensor([0, 3, 6]), 7, sink=1, window=2)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],  # position 0 reads itself only
            [1, 0, 1, 1, 0, 0, 0],  # sink 0, window 2..3
            [1, 0, 0, 0, 0, 1, 1],  # sink 0, window 5..6
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)


@pytest.mark.parametrize(("rows", "chunk_floats"), [(40, 1 << 24), (40, 300), (9, 300)])
def test_restricted_heads_score_only_the_short_cache_keys_with_the_full_masked_softmax_numbers(
    rows: int, chunk_floats: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scoring only the sink and the chunk's windows equals the softmax over every key with the rest masked (1e-6),
    in one chunk or many, for a prompt (rows = keys) and for the last rows of one (rows < keys), with padding."""
    from agent_tools import restricted_attention

    monkeypatch.setattr(restricted_attention, "_CHUNK_FLOATS", chunk_floats)
    generator = torch.Generator().manual_seed(11)
    batch, heads, keys, dim, sink, window = 2, 4, 40, 8, 2, 5
    query = torch.randn(batch, heads, rows, dim, generator=generator)
    key = torch.randn(batch, heads, keys, dim, generator=generator)
    value = torch.randn(batch, heads, keys, dim, generator=generator)
    positions = torch.arange(keys - rows, keys)
    causal = torch.arange(keys)[None, :] <= positions[:, None]  # (q, Tk)
    allowed = causal[None].repeat(batch, 1, 1)
    allowed[1, :, 3] = False  # row 1 pads key 3 (a sink-side key) and key 20
    allowed[1, :, 20] = False
    pairs = [(0, 1), (1, 1), (1, 3)]
    got, first = restricted_attention._restricted_heads(
        query, key, value, allowed, pairs, 0.3, sink=sink, window=window
    )
    assert first == max(0, sink + window - (keys - rows))
    rows_b, heads_h = torch.tensor([b for b, _ in pairs]), torch.tensor([h for _, h in pairs])
    mask = allowed[rows_b] & short_cache_allowed(positions, keys, sink=sink, window=window)[None]
    scores = (query[rows_b, heads_h] @ key[rows_b, heads_h].transpose(-1, -2) * 0.3).masked_fill(~mask, -torch.inf)
    expected = torch.softmax(scores, -1).nan_to_num(0.0) @ value[rows_b, heads_h]  # (P, q, D), every key scored
    torch.testing.assert_close(got, expected[:, first:], atol=1e-6, rtol=0)


def test_greedy_plan_and_bytes_by_hand() -> None:
    plan = greedy_plan([0.3, -0.1, 0.05, 0.0, 0.2], 0.2)
    # smallest first: -0.1, 0.0, 0.05, 0.2 sum to 0.15 <= 0.2; adding 0.3 would make 0.45
    assert plan.chosen == (1, 3, 2, 4) and plan.predicted == pytest.approx(0.15)
    assert greedy_plan([0.1], 0.0).chosen == ()
    with pytest.raises(ValueError, match=">= 0"):
        greedy_plan([0.1], -1.0)
    # SmolLM2: 30 layers x 3 KV heads x 64 dims x 2 (K, V) x 2 bytes x 8,192 tokens
    assert kv_cache_bytes(layers=30, kv_heads=3, head_dim=64, tokens=8192, bytes_per_number=2) == 188_743_680
    assert short_cache_saving(planned_kv_heads=2, head_dim=64, tokens=100, cache_tokens=20, bytes_per_number=2) == (
        2 * 64 * 2 * 2 * 80
    )


def _interacting(picked) -> tuple[float, float]:
    """A constructed joint effect: the units' own changes add up, except units 2 and 3 together cost 0.02 more."""
    changes = [0.01, 0.0, 0.02, 0.03, -0.01]
    both = 2 in picked and 3 in picked
    return sum(changes[i] for i in picked) + (0.02 if both else 0.0), 0.5


def test_verified_greedy_by_hand() -> None:
    changes = [0.01, 0.0, 0.02, 0.03, -0.01]
    plan = verified_greedy(changes, 0.06, 0.005, _interacting, max_runs=20)
    # order 4, 1, 0, 2, 3. Run 1: the additive plan (all five, predicted 0.05) verifies at 0.07 > 0.06: halve.
    # Run 2: [4, 1] -0.01 as predicted. Run 3: [0, 2, 3] predicted 0.05, verified 0.07: rejected, halve to one.
    # Run 4: [0] 0.0. Run 5: [2, 3] 0.05 vs 0.07: rejected. Run 6: [2] 0.02. Run 7: [3] 0.05 vs 0.07: skipped.
    assert [step.added for step in plan.steps] == [(4, 1, 0, 2, 3), (4, 1), (0, 2, 3), (0,), (2, 3), (2,), (3,)]
    assert [step.accepted for step in plan.steps] == [False, True, False, True, False, True, False]
    assert plan.chosen == (4, 1, 0, 2)
    assert plan.predicted == pytest.approx(0.02) and plan.verified == pytest.approx(0.02)
    assert plan.additive == pytest.approx(0.02) and plan.agreement == 0.5
    assert plan.steps[2].predicted == pytest.approx(0.05) and plan.steps[2].verified == pytest.approx(0.07)
    # within the budget but outside the tolerance is rejected too; a wide tolerance takes the additive plan at once
    assert verified_greedy(changes, 0.2, 0.005, _interacting, max_runs=20).chosen == (4, 1, 0, 2)
    wide = verified_greedy(changes, 0.2, 0.03, _interacting, max_runs=20)
    assert wide.chosen == (4, 1, 0, 2, 3) and len(wide.steps) == 1
    assert wide.predicted == pytest.approx(0.05) and wide.verified == pytest.approx(0.07)
    # the run limit stops the search; an empty plan predicts and verifies 0
    assert verified_greedy(changes, 0.06, 0.005, _interacting, max_runs=2).chosen == (4, 1)
    empty = verified_greedy([0.1, 0.2], 0.05, 0.01, _interacting, max_runs=20)
    assert empty.chosen == () and empty.steps == () and (empty.predicted, empty.verified, empty.agreement) == (0, 0, 1)


@pytest.fixture(scope="module")
def tiny_llama() -> LoadedModel:
    from families import tiny_tokenizer

    return register_model("tiny-llama-shortcache", build_family("llama"), tiny_tokenizer())


def _reference_losses(model: torch.nn.Module, ids: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """Every head of every layer on the short cache: eager attention with the sink + window mask given as 4D."""
    length = ids.shape[-1]
    allowed = short_cache_allowed(torch.arange(length), length, sink=sink, window=window)
    mask = torch.zeros(length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    with torch.inference_mode(), attention_implementation(model, "eager"):
        logits = model(input_ids=ids, attention_mask=mask).logits[0].float()
    return torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")


def test_every_head_restricted_equals_eager_attention_with_the_short_cache_mask(tiny_llama: LoadedModel) -> None:
    ids = torch.randint(4, 60, (1, 24), generator=torch.Generator().manual_seed(3))
    facts = tiny_llama.facts
    every = {layer: [(0, tuple(range(facts.num_heads)))] for layer in range(facts.num_layers)}
    losses, _ = restricted_pass(tiny_llama, ids, every, rows=1, sink=2, window=5, scored_from=7)
    reference = _reference_losses(tiny_llama.model, ids, 2, 5)
    torch.testing.assert_close(losses[0], reference[7:], atol=1e-5, rtol=1e-5)
    # and the restriction matters on this random model (the check above is not vacuous)
    clean, _ = restricted_pass(tiny_llama, ids, {}, rows=1, sink=2, window=5, scored_from=7)
    assert (clean[0] - losses[0]).abs().max() > 1e-3


def test_joining_rows_equal_one_pass_per_unit(tiny_llama: LoadedModel) -> None:
    ids = torch.randint(4, 60, (1, 20), generator=torch.Generator().manual_seed(5))
    units = [(0, (0, 1)), (0, (2, 3)), (1, (0, 1)), (1, (2, 3))]
    measured = unit_losses(tiny_llama, ids, units, sink=1, window=4, max_rows=3)  # two units per pass
    assert measured.passes == 2
    for index, (layer, heads) in enumerate(units):
        alone, _ = restricted_pass(tiny_llama, ids, {layer: [(1, heads)]}, rows=2, sink=1, window=4, scored_from=5)
        torch.testing.assert_close(measured.rows[index], alone[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(measured.clean_rows[index], alone[0], atol=1e-5, rtol=1e-5)


def test_row_zero_leaves_every_pass_but_the_last_with_the_same_numbers(tiny_llama: LoadedModel) -> None:
    ids = torch.randint(4, 60, (1, 20), generator=torch.Generator().manual_seed(7))
    units = [(0, (0, 1)), (0, (2, 3)), (1, (0, 1)), (1, (2, 3))]
    blocks = tiny_llama.model.model.layers
    assert len(blocks) == 2
    seen: list[tuple[int, int]] = []  # (layer, rows out of its block)
    hooks = [
        block.register_forward_hook(
            lambda module, args, output, layer=layer: seen.append(
                (layer, (output[0] if isinstance(output, tuple) else output).shape[0])
            )
        )
        for layer, block in enumerate(blocks)
    ]
    try:
        measured = unit_losses(tiny_llama, ids, units, sink=1, window=4, max_rows=3)
    finally:
        for hook in hooks:
            hook.remove()
    # pass 1: row 0 + the 2 layer-0 units leave layer 0, then row 0 leaves; pass 2 (the last): row 0 runs to the end
    assert seen == [(0, 3), (1, 2), (0, 1), (1, 3)]
    # the previous schedule: row 0 in every pass to the end, each unit against its own pass's row 0
    rows, clean_rows = [], []
    for group in (units[:2], units[2:]):
        restrictions = {group[0][0]: [(1, group[0][1]), (2, group[1][1])]}
        before, _ = restricted_pass(
            tiny_llama, ids, restrictions, rows=3, sink=1, window=4, joining={group[0][0]: 2}, scored_from=5
        )
        rows.append(before[1:])
        clean_rows.append(before[:1].expand(2, -1))
    torch.testing.assert_close(measured.rows, torch.cat(rows), atol=1e-6, rtol=0)
    torch.testing.assert_close(measured.clean_rows, torch.cat(clean_rows), atol=1e-6, rtol=0)
    assert measured.passes == 2 and measured.rows.shape == (4, 20 - 1 - 5)
    assert (measured.rows - measured.clean_rows).abs().max() > 1e-3  # the restrictions change the losses


@pytest.fixture(scope="module")
def circuit() -> LoadedModel:
    return register_model("circuit-shortcache", induction_circuit(), circuit_tokenizer())


def test_known_answer_local_heads_planned_with_zero_change_induction_head_kept(
    circuit: LoadedModel, inspector: Inspector
) -> None:
    arguments = {"model": "circuit-shortcache", "text": CIRCUIT_TEXT, "sink": 1, "window": 3, "loss_budget": 1e-3}
    report = get_tool("plan_kv_cache")(inspector, {**arguments, "detail": "full"})
    by_head = {(h.layer, h.kv_head): h for h in report.heads}
    induction = by_head[INDUCTION_HEAD]
    assert induction.loss_change > 0.5 and not induction.planned  # it reads the first half from far back
    others = [h for key, h in by_head.items() if key != INDUCTION_HEAD]
    assert len(others) == 7 and all(h.planned and abs(h.loss_change) < 1e-5 for h in others)
    assert all(h.top_token_agreement == 1.0 for h in others)
    assert report.plan.planned_kv_heads == 7 and abs(report.plan.verified_loss_change) < 1e-5
    assert report.plan.verified_top_token_agreement == 1.0
    # 7 of 8 KV heads keep 4 tokens instead of the model's 64: 7 x 32 dims x 2 x 2 bytes x 60 tokens
    assert report.memory.context_length == 64 and report.memory.saved_bytes == 7 * 32 * 2 * 2 * 60
    assert report.masked_passes == 2 and "this text" in report.measured_on
    assert report.plan.additive_kv_heads == 7


@pytest.mark.real_model
def test_default_model_plan_predicted_and_verified_agree_within_the_tolerance(
    smol: LoadedModel, inspector: Inspector
) -> None:
    """The example (6 layers, 43 tokens, window 8, budget 0.05, tolerance 0.025 = half of it): the plan's predicted
    and verified loss changes agree within the stated tolerance, the verified change fits the budget, and running
    the planned heads again at once (a fresh two-row pass) gives the reported verified change."""
    from agent_tools.long_context import all_restricted_losses

    spec = get_tool("plan_kv_cache")
    report = spec(inspector, {**spec.example, "detail": "full"})
    plan = report.plan
    assert plan.tolerance == pytest.approx(report.loss_budget / 2)
    assert plan.verified_loss_change <= report.loss_budget + 1e-9
    assert abs(plan.verified_loss_change - plan.predicted_loss_change) <= plan.tolerance + 1e-6
    assert plan.planned_kv_heads == sum(h.planned for h in report.heads) > 0
    assert plan.loss_planned == pytest.approx(plan.loss_full + plan.verified_loss_change, abs=2e-4)
    accepted = [step for step in plan.steps if step.accepted]
    assert sum(step.added_kv_heads for step in accepted) == plan.planned_kv_heads
    assert report.masked_passes == len(plan.steps) + 1  # 18 KV heads: one measuring pass of 19 rows
    planned = [(h.layer, tuple(h.query_heads)) for h in report.heads if h.planned]
    encoded = inspector.encode(smol, spec.example["text"])
    losses, _ = all_restricted_losses(smol, encoded.input_ids, planned, sink=report.sink, window=report.window)
    assert float((losses[1] - losses[0]).double().mean()) == pytest.approx(plan.verified_loss_change, abs=1e-5)


def test_bad_input_names_the_valid_range(circuit: LoadedModel, inspector: Inspector) -> None:
    tool = get_tool("plan_kv_cache")
    base = {"model": "circuit-shortcache", "text": "the cat sat on mat red blue"}
    with pytest.raises(InvalidInputError, match=r"covers the whole text.*sink \+ window <= 6"):
        tool(inspector, {**base, "sink": 2, "window": 6})
    with pytest.raises(InvalidInputError, match=">= 0"):
        tool(inspector, {**base, "sink": 1, "window": 2, "loss_budget": -0.1})
    with pytest.raises(InvalidInputError, match="tolerance >= 0"):
        tool(inspector, {**base, "sink": 1, "window": 2, "tolerance": -0.01})
    with pytest.raises(ResourceLimitError, match=r"outside 1\.\.64"):
        tool(inspector, {**base, "sink": 1, "window": 2, "context_length": 100})
    # a row of n tokens: n x hidden x 24 floats, the output's vocabulary row and, eager, 2 x heads x n² scores
    # (float32); a budget of exactly two rows of 3 tokens names 3 as the longest text
    facts, vocabulary = circuit.facts, circuit.model.get_output_embeddings().weight.shape[0]
    three = (3 * facts.hidden_size * 24 + vocabulary + 2 * facts.num_heads * 9) * 4
    with pytest.raises(ResourceLimitError, match=r"over the budget.*a text of at most 3 tokens"):
        tool(Inspector(memory_budget=2 * three), {**base, "sink": 1, "window": 2})
    with pytest.raises(ResourceLimitError, match=r"at most 64 tokens"):
        tool(inspector, {**base, "text": " ".join(["cat"] * 70), "sink": 1, "window": 2})
