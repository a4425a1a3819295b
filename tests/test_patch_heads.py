"""patch_heads: activation patching names exactly the heads of a hand-built induction circuit (with hand-computed
fractions per head, per layer and per position), the batched rows equal one patched forward each, bad input."""

from __future__ import annotations

import adapted
import pytest
import torch
from crafted import INDUCTION_HEAD, PREVIOUS_HEAD, circuit_tokenizer, induction_circuit

from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.layout import output_projection
from agent_tools.loading import LoadedModel, register_model
from agent_tools.tools import get_tool
from agent_tools.tools.patch_heads import PatchReport

# clean: the last 'cat' follows 'dog' earlier -> 'dog'; corrupted: swap 'cat' and 'sun' -> 'cat' precedes 'moon'
CLEAN, CORRUPTED = "cat dog sun moon cat", "sun dog cat moon cat"


@pytest.fixture(scope="module")
def circuit() -> LoadedModel:
    return register_model("circuit-patch", induction_circuit(), circuit_tokenizer())


def _patch(inspector: Inspector, **extra) -> PatchReport:
    arguments = {"model": "circuit-patch", "clean": CLEAN, "corrupted": CORRUPTED, **extra}
    return get_tool("patch_heads")(inspector, arguments)


def test_known_circuit_previous_token_and_induction_heads_restore_everything(circuit, inspector: Inspector) -> None:
    report = _patch(inspector)
    assert (report.answer, report.wrong) == ("dog", "moon")  # the two prompts' own top tokens
    assert report.logit_difference_clean == pytest.approx(-report.logit_difference_corrupted, abs=1e-4)
    assert report.logit_difference_clean > 5
    grid = {(h.layer, h.head): h.restored for h in report.heads}
    # by construction: L0H0's previous-token write keys L1H0's match; L1H0 copies the answer; nothing else writes
    # anything that depends on the prompt
    assert grid == {**dict.fromkeys(grid, 0.0), PREVIOUS_HEAD: 1.0, INDUCTION_HEAD: 1.0}
    assert [(r.layer, r.restored) for r in report.layer_results] == [(0, 1.0), (1, 1.0)]
    assert [(h.layer, h.head) for h in report.top_heads[:2]] == [PREVIOUS_HEAD, INDUCTION_HEAD]
    assert report.first_difference == 1 and report.differing_positions == [1, 3]
    positions = {(p.layer, p.head): [x.restored for x in p.positions] for p in report.positions}
    # L1H0 acts at the last position only. L0H0 at position 2 makes it match both 2 and 4 (50/50: 'dog' and
    # 'moon' equally, LD 0 -> half); at position 4 it removes the corrupted match (no key matches: LD 0 -> half)
    assert positions[INDUCTION_HEAD] == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert positions[PREVIOUS_HEAD] == [0.0, 0.0, 0.5, 0.0, 0.5, 0.0]
    assert report.patched_runs == 8 + 2 + 3 * 5
    assert report.summary.startswith("Logit difference 'dog' − 'moon'")
    assert [c.tool for c in report.next_calls] == ["ablate_heads", "profile_heads"]
    assert report.next_calls[0].arguments["heads"][:2] == ["0.0", "1.0"]


def test_layers_subset_and_explicit_tokens(circuit, inspector: Inspector) -> None:
    report = _patch(inspector, layers=[1], answer="dog", wrong="moon", per_position=False, top_k=1)
    assert [(h.layer, h.head) for h in report.heads] == [(1, h) for h in range(4)]
    assert report.top_heads[0].restored == 1.0 and report.positions == [] and report.patched_runs == 5


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "bloom", "falcon_alibi", "falcon"])
def test_batched_rows_equal_one_patched_forward_each(family: str, tiny_models, inspector: Inspector) -> None:
    """Every row of the joining batch (rows enter at the layer they patch, as copies of the unpatched row) equals
    a plain forward with that one head's output replaced; BLOOM's per-batch ALiBi and Falcon's parallel block too."""
    if family in adapted.DECODERS:
        name = f"tiny-patch-{family}"
        loaded = register_model(name, adapted.build(family), tiny_models["llama"].tokenizer)
    else:
        name, loaded = f"tiny-{family}", tiny_models[family]
    arguments = {
        "model": name,
        "clean": "the cat sat on the mat because it",
        "corrupted": "the dog sat on the mat because it",
        "answer": "was",
        "wrong": "tired",
        "top_k": 8,
        "detail": "full",
    }
    report = get_tool("patch_heads")(inspector, arguments)
    assert {row.layer for row in report.heads} == {0, 1}  # rows joining at both layers
    facts = loaded.facts
    clean = inspector.encode(loaded, arguments["clean"])
    corrupted = inspector.encode(loaded, arguments["corrupted"])
    was, tired = (loaded.tokenizer.convert_tokens_to_ids(w) for w in ("was", "tired"))
    recorded = inspector.recorded_run(loaded, clean).heads
    model, width = loaded.model, facts.head_dim
    for row in report.heads:  # one forward per head with a plain replacement hook
        projection = output_projection(model, row.layer, in_features=facts.num_heads * width)

        def hook(module, args, layer=row.layer, head=row.head):
            x = args[0].clone()
            x[0, :, head * width : (head + 1) * width] = recorded[layer][:, head].reshape(x.shape[1], width)
            return (x, *args[1:])

        handle = projection.register_forward_pre_hook(hook)
        try:
            with torch.inference_mode():
                logits = model(input_ids=corrupted.input_ids).logits[0, -1]
        finally:
            handle.remove()
        assert row.logit_difference == pytest.approx(float(logits[was] - logits[tired]), abs=1e-4)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"corrupted": "sun dog cat moon cat cat"},
            r"clean is 6 tokens and corrupted is 7 tokens; .* same number of tokens: change words for words of the "
            r"same token count",
        ),
        ({"answer": "dog moon"}, r"answer 'dog moon' is 2 tokens \(\['dog', 'moon'\]\) .* give exactly one token"),
        ({"answer": "dog", "wrong": "dog"}, r"answer and wrong are the same token 'dog'; give two different"),
        ({"corrupted": CLEAN}, r"clean and corrupted are the same tokens"),
        ({"answer": "red", "wrong": "blue"}, r"same logit difference .* nothing to restore"),
        ({"layers": [2]}, r"out of range 0\.\.1"),
    ],
)
def test_bad_input(arguments: dict, message: str, circuit, inspector: Inspector) -> None:
    with pytest.raises(InvalidInputError, match=message):
        _patch(inspector, **arguments)


def test_an_encoder_is_refused(tiny_models, inspector: Inspector) -> None:
    with pytest.raises(InvalidInputError, match=r"has no next-token head; patch_heads needs a language model"):
        get_tool("patch_heads")(inspector, {"model": "tiny-bert", "clean": "the cat", "corrupted": "the dog"})
