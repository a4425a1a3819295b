"""find_retrieval_heads: Wu et al.'s score by hand, the known-answer induction circuit, bad input."""

from __future__ import annotations

import pytest
import torch
from crafted import INDUCTION_HEAD, circuit_tokenizer, induction_circuit

from agent_tools.analysis.long_context import retrieval_hits, retrieval_score
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel, register_model
from agent_tools.long_context import build_haystack, needle_tokens
from agent_tools.tools import get_tool

HAYSTACK = "the cat dog sat on mat red blue green one two three four five six seven eight nine ten sun moon tree"
NEEDLE = {"needle": "king queen star", "answer": "queen star", "question": "king"}


def test_retrieval_hits_by_hand() -> None:
    ids = torch.tensor([0, 5, 7, 8, 9, 5, 7, 8])  # needle 7 8 at positions 2..3; answer 7 8 generated at 6, 7
    top = torch.tensor([[2, 3], [6, 3], [2, 2]])  # head 0 copies both; head 1 one; head 2 reads the right span,
    hits = retrieval_hits(top, [5, 6], ids, (2, 4))  # but token 7 when 8 is produced at the second step
    assert hits.tolist() == [[True, True], [False, True], [True, False]]
    assert retrieval_score(hits).tolist() == [1.0, 0.5, 0.5]


@pytest.fixture(scope="module")
def circuit() -> LoadedModel:
    return register_model("circuit-retrieval", induction_circuit(), circuit_tokenizer())


def test_haystack_places_the_needle_and_the_answer_rows(circuit: LoadedModel) -> None:
    pieces = needle_tokens(circuit, HAYSTACK, **NEEDLE)
    hay = build_haystack(pieces, 40, 0.5)
    tokens = circuit.tokenizer.convert_ids_to_tokens(hay.ids.tolist())
    start, stop = hay.needle
    assert tokens[0] == "<bos>" and tokens[start:stop] == ["king", "queen", "star"] and hay.length == 40
    assert tokens[-3:] == ["king", "queen", "star"] and hay.answer_queries == (37, 38)
    assert start == 1 + round(0.5 * (40 - 1 - 3 - 1 - 2))


def test_known_answer_the_induction_head_is_the_retrieval_head_and_retrieval_needs_it(
    circuit: LoadedModel, inspector: Inspector
) -> None:
    arguments = {
        "model": "circuit-retrieval",
        "text": HAYSTACK,
        **NEEDLE,
        "depths": [0.2, 0.5, 0.8],
        "lengths": [32, 48],
        "top_k": 1,
        "random_draws": 3,
        "detail": "full",
    }
    report = get_tool("find_retrieval_heads")(inspector, arguments)
    assert [(h.layer, h.head, h.score, h.score_sd) for h in report.heads] == [(*INDUCTION_HEAD, 1.0, 0.0)]
    assert report.score_grid[1][0] == 1.0 and sum(map(sum, report.score_grid)) == 1.0
    assert len(report.haystacks) == 6 and all(h.accuracy == 1.0 for h in report.haystacks)
    causal = report.causal
    assert causal.ablated == ["1.0"] and causal.accuracy_clean == 1.0 and causal.accuracy_top_ablated == 0.0
    assert causal.logprob_top_ablated < causal.logprob_clean


def test_bad_input_names_the_valid_range(circuit: LoadedModel, inspector: Inspector) -> None:
    tool = get_tool("find_retrieval_heads")
    base = {"model": "circuit-retrieval", "text": HAYSTACK, **NEEDLE, "lengths": [32]}
    with pytest.raises(InvalidInputError, match=r"longer than the haystack text \(2 tokens\).*at least \d+ tokens"):
        tool(inspector, {**base, "text": "the cat"})
    with pytest.raises(ResourceLimitError, match=r"over this model's limit.*lengths 8\.\.64"):
        tool(inspector, {**base, "lengths": [100]})
    with pytest.raises(InvalidInputError, match=r"lengths 8\.\.64"):
        tool(inspector, {**base, "lengths": [6]})
    with pytest.raises(InvalidInputError, match=r"outside 0\.\.1"):
        tool(inspector, {**base, "depths": [1.5]})
    with pytest.raises(InvalidInputError, match="part of the needle"):
        tool(inspector, {**base, "answer": "moon"})
    with pytest.raises(ResourceLimitError, match="lengths <="):
        tool(Inspector(memory_budget=1000), base)


def test_only_the_answer_positions_reach_the_output_head(
    circuit: LoadedModel, inspector: Inspector, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scores need no logits (the capture pass stops before the head), the mean recording keeps the last
    # position's, the ablation rows the answer queries' only, and the path gap (issue 30) its last GAP_POSITIONS:
    # memory does not grow with haystack length times vocabulary.
    from agent_tools.runner import paths

    answer = len(circuit.tokenizer(" " + NEEDLE["answer"], add_special_tokens=False)["input_ids"])
    monkeypatch.setattr(paths, "GAP_POSITIONS", answer + 1)
    seen: list[tuple[int, ...]] = []
    head = circuit.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _module, _inputs, output: seen.append(tuple(output.shape)))
    try:
        arguments = {"model": "circuit-retrieval", "text": HAYSTACK, **NEEDLE, "lengths": [48], "depths": [0.5]}
        report = get_tool("find_retrieval_heads")(inspector, {**arguments, "top_k": 1, "random_draws": 2})
    finally:
        hook.remove()
    assert seen and all(shape[1] in (1, answer + 1) for shape in seen), seen  # from the first answer query on
    assert sum(1 for shape in seen if shape[0] == 4) == 1  # the clean row, the top set and 2 random sets: 1 batch
    assert report.causal.accuracy_clean == 1.0 and report.causal.accuracy_top_ablated == 0.0
