"""patch_heads: activation patching names exactly the heads of a hand-built induction circuit (with hand-computed
fractions per head, per layer and per position), the batched rows equal one patched forward each, bad input."""

from __future__ import annotations

import adapted
import pytest
import torch
from crafted import INDUCTION_HEAD, PREVIOUS_HEAD, circuit_tokenizer, induction_circuit

from agent_tools.analysis.metrics import next_token_losses
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.layout import output_projection
from agent_tools.loading import LoadedModel, register_model
from agent_tools.runner.patching import HeadPatch, patched_outputs, recorded_run
from agent_tools.runner.readout import PositionLosses, last_position
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
    # every head alone, every layer's heads together, the top 3 together and 8 random sets of 3, 3 heads × 5 positions
    assert report.patched_runs == 8 + 2 + (1 + 8) + 3 * 5
    assert report.method == "exact" and report.attribution is None
    # sized against the rest: the 5 heads outside the top 3 restore exactly 0 each, so the top two are large and
    # L0H1 (third by |restored|, 0) small; the top 3 together restore all of it, 8 random sets of 3 heads from the
    # other 5 restore 0 (none holds a circuit head)
    assert report.single_head_baseline.model_dump() == {"mean": 0.0, "spread": 0.0, "draws": 5, "heads": 1}
    assert [h.size for h in report.top_heads] == ["large", "large", "small"]
    top_set = report.top_set
    assert top_set is not None and top_set.heads == ["0.0", "1.0", "0.1"] and top_set.restored == 1.0
    assert top_set.baseline.model_dump() == {"mean": 0.0, "spread": 0.0, "draws": 8, "heads": 3}
    assert (top_set.size, top_set.top_token_corrupted, top_set.top_token_patched) == ("large", "moon", "dog")
    assert top_set.change == "flip" and top_set.p_new - top_set.p_old >= report.tie_margin
    logits = recorded_run(circuit, inspector.encode(circuit, CLEAN).input_ids).output[-1]
    assert report.gap_threshold == pytest.approx(0.25 * float(logits.double().std()), abs=1e-4)
    assert "restores +100.0% of it, toward 'dog' (large: one random head +0.0% ± 0.0%, 5 heads)" in report.summary
    assert "the top token flips: 'moon' → 'dog'" in report.summary
    assert report.summary.startswith("Logit difference 'dog' − 'moon'")
    assert [c.tool for c in report.next_calls] == ["ablate_heads", "profile_heads"]
    assert report.next_calls[0].arguments["heads"][:2] == ["0.0", "1.0"]


def test_layers_subset_and_explicit_tokens(circuit, inspector: Inspector) -> None:
    report = _patch(inspector, layers=[1], answer="dog", wrong="moon", per_position=False, top_k=1)
    assert [(h.layer, h.head) for h in report.heads] == [(1, h) for h in range(4)]
    assert report.top_heads[0].restored == 1.0 and report.positions == [] and report.patched_runs == 5 + (1 + 8)


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
        "corrupted": "the dog sat on the mat because the",  # the last word too: random weights move little else
        "top_k": 8,
        "detail": "full",
    }
    facts = loaded.facts
    clean = inspector.encode(loaded, arguments["clean"])
    corrupted = inspector.encode(loaded, arguments["corrupted"])
    # the two answer words whose logit difference the prompts move most (random weights: a gap worth dividing by)
    with torch.inference_mode():
        change = loaded.model(input_ids=clean.input_ids).logits[0, -1] - loaded.model(corrupted.input_ids).logits[0, -1]
    tokenizer = loaded.tokenizer
    words = [w for w, i in tokenizer.get_vocab().items() if tokenizer(w, add_special_tokens=False)["input_ids"] == [i]]
    ranked = sorted(words, key=lambda w: float(change[tokenizer.convert_tokens_to_ids(w)]))
    arguments.update(answer=ranked[-1], wrong=ranked[0])
    was, tired = (tokenizer.convert_tokens_to_ids(w) for w in (ranked[-1], ranked[0]))
    report = get_tool("patch_heads")(inspector, arguments)
    assert {row.layer for row in report.heads} == {0, 1}  # rows joining at both layers
    recorded = recorded_run(loaded, clean.input_ids).heads
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
        (
            {"answer": "red", "wrong": "blue"},
            r"logit differences .* apart: below 0\.418 \(0\.25 × the standard .* too small .* nothing to restore",
        ),
        ({"verify": 0}, r"verify"),
        ({"layers": [2]}, r"out of range 0\.\.1"),
    ],
)
def test_bad_input(arguments: dict, message: str, circuit, inspector: Inspector) -> None:
    with pytest.raises(InvalidInputError, match=message):
        _patch(inspector, **arguments)


def test_a_gap_too_small_to_divide_by_is_refused_with_the_threshold(tiny_models, inspector: Inspector) -> None:
    """On the tiny Llama, LD(tired − cat) is 0.0031 apart between the prompts: above the old 1e-4 floor, below
    0.25 × the clean logits' standard deviation (0.115), so no percentage is printed."""
    arguments = {
        "model": "tiny-llama",
        "clean": "the cat sat on the mat because it",
        "corrupted": "the dog sat on the mat because it",
        "answer": "tired",
        "wrong": "cat",
    }
    with pytest.raises(InvalidInputError, match=r"0\.00\d+ apart: below 0\.02\d+ \(0\.25 × the standard deviation"):
        get_tool("patch_heads")(inspector, arguments)


@pytest.mark.real_model
def test_attribution_recalls_exact_patching_top_heads_on_the_default_model(smol, inspector: Inspector) -> None:
    """A factual-recall pair on SmolLM2-135M: attribution's top-10 heads hold at least 8 of exact patching's top-10
    (measured 9/10; benchmarks/bench_attribution_patching.py also runs an IOI and an induction pair), and the
    report's verification patches the candidates exactly."""
    arguments = {
        "model": "smollm2-135m-instruct",
        "clean": "The capital of France is the city of",
        "corrupted": "The capital of Italy is the city of",
        "answer": " Paris",
        "wrong": " Rome",
        "per_position": False,
        "detail": "full",
    }
    exact = get_tool("patch_heads")(inspector, {**arguments, "method": "exact"})
    attribution = get_tool("patch_heads")(inspector, {**arguments, "method": "attribution", "top_k": 10})
    exact_top = {(h.layer, h.head) for h in sorted(exact.heads, key=lambda h: -abs(h.restored))[:10]}
    check = attribution.attribution
    assert check is not None and check.verified_top == 20 and check.verified_random == 10
    candidates = [(h.layer, h.head) for h in attribution.heads[:10]]  # the estimate's top 10, patched exactly
    assert len(exact_top & set(candidates)) >= 8
    values = {(h.layer, h.head): h.restored for h in exact.heads}
    # the same patch in another batch: float32 agrees to 1e-3 of the gap; bfloat16 (auto on a CPU with bfloat16
    # hardware) rounds logits of ~7 to 2**-5, and the rows' batch changes the matmuls' rounding: measured 0.015
    tolerance = 1e-3 if exact.dtype == "float32" else 0.03
    assert all(values[(h.layer, h.head)] == pytest.approx(h.restored, abs=tolerance) for h in attribution.heads)
    assert check.recall >= 8 and check.k == 10


def test_an_encoder_is_refused(tiny_models, inspector: Inspector) -> None:
    with pytest.raises(InvalidInputError, match=r"has no next-token head; patch_heads needs a language model"):
        get_tool("patch_heads")(inspector, {"model": "tiny-bert", "clean": "the cat", "corrupted": "the dog"})


def test_patched_rows_keep_only_what_the_metric_reads(tiny_models, inspector: Inspector) -> None:
    """A patched row keeps two logits, the log-sum-exp and the top token at the last position (or per-position
    losses), equal to what the whole (R, K, V) output gave to 1e-6; the output head sees one position of at most
    a batch's rows, and no tensor kept has a vocabulary axis."""
    loaded = tiny_models["llama"]
    facts = loaded.facts
    clean = inspector.encode(loaded, "the cat sat on the mat because it")
    corrupted = inspector.encode(loaded, "the cat sat on the dog because it")
    sources = recorded_run(loaded, clean.input_ids).heads
    patches = [HeadPatch(layer, (head,)) for layer in range(facts.num_layers) for head in range(facts.num_heads)]
    rows, vocabulary = len(patches), loaded.model.get_output_embeddings().weight.shape[0]

    def whole(output: torch.Tensor) -> tuple[torch.Tensor]:  # what every row kept before: (K, V) float32
        return (output.float(),)

    before = patched_outputs(loaded, corrupted.input_ids, patches, readout=whole, sources=sources)[0]
    assert before.shape == (rows, 1, vocabulary)
    shapes: list[tuple[int, ...]] = []
    head = loaded.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    try:
        kept = patched_outputs(
            loaded, corrupted.input_ids, patches, readout=last_position((5, 9)), sources=sources, max_rows=3
        )
    finally:
        handle.remove()
    chosen, normaliser, top_logit, top = kept
    assert [tuple(t.shape) for t in kept] == [(rows, 2), (rows,), (rows,), (rows,)]
    assert len(shapes) == -(-rows // 3) and all(s[0] <= 4 and s[1] == 1 for s in shapes)  # ≤ 3 rows + row 0
    last = before[:, -1]  # (R, V)
    torch.testing.assert_close(chosen, last[:, [5, 9]], atol=1e-6, rtol=0)
    torch.testing.assert_close(normaliser, torch.logsumexp(last.double(), -1).float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(top_logit, last.amax(-1), atol=1e-6, rtol=0)  # batches of 3 rows vs 64: 3e-8
    assert top.tolist() == last.argmax(-1).tolist()
    # every position's next-token loss (profile_heads' mean-ablation evidence): (R, T−1), not (R, T, V)
    ids = corrupted.input_ids
    full = patched_outputs(loaded, ids, patches, readout=whole, sources=sources, keep_last=False)[0]
    (losses,) = patched_outputs(loaded, ids, patches, readout=PositionLosses(ids), sources=sources, keep_last=False)
    assert losses.shape == (rows, ids.shape[-1] - 1)
    torch.testing.assert_close(losses.double(), next_token_losses(full, ids.expand(rows, -1)), atol=1e-6, rtol=0)


def test_a_rows_size_counts_one_layers_scores_where_attention_is_eager(tiny_models) -> None:
    """Eager attention holds a layer's (heads, T, T) scores and weights in float32 while a row runs; sdpa's kernels
    never do. At 8,192 tokens on a 4-head model that is 2 GiB a row against 3 MiB of activations: batches sized
    without it allocated 65 GiB (the 8,192-token budget test of patch_heads)."""
    from agent_tools.runner.patching import ROW_ACTIVATION_FLOATS, row_bytes, rows_per_batch

    loaded = tiny_models["llama"]
    facts = loaded.facts
    vocabulary = loaded.model.get_output_embeddings().weight.shape[0]
    activations = (100 * facts.hidden_size * ROW_ACTIVATION_FLOATS + vocabulary) * 4
    maps = 2 * facts.num_heads * 100 * 100 * 4
    config = loaded.model.config
    before = config._attn_implementation
    try:
        config._attn_implementation = "eager"
        assert row_bytes(loaded, 100) == activations + maps
        assert rows_per_batch(loaded, 8192, 2 * 1024**3) == 1  # ≥ 1 row, never a batch of 64 over the budget
        config._attn_implementation = "sdpa"
        assert row_bytes(loaded, 100) == activations
    finally:
        config._attn_implementation = before
