"""find_circuit: EAP-IG edges on the hand-set induction circuit (known answer) and bad input."""

from __future__ import annotations

import pytest
import torch
from crafted import circuit_tokenizer, induction_circuit

from agent_tools.analysis.edge_attribution import curve_sizes, edge_scores, interpolation_points
from agent_tools.errors import InvalidInputError
from agent_tools.loading import register_model
from agent_tools.runner.patching import HeadPatch
from agent_tools.tools import get_tool

CLEAN, CORRUPTED = "cat dog sun moon cat", "sun dog cat moon cat"


def _whole(output: torch.Tensor) -> tuple[torch.Tensor]:
    """A readout that keeps every row's whole output (tiny models only: the tests compare full logits)."""
    return (output.float(),)


def test_pure_pieces() -> None:
    assert interpolation_points(5).tolist() == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9])
    deltas = torch.tensor([[[1.0, 2.0]], [[0.0, -1.0]]])  # (S=2, T=1, C=2)
    grads = torch.tensor([[[3.0, 4.0]]])  # (R=1, T=1, C=2)
    assert edge_scores(deltas, grads).tolist() == [[11.0], [-4.0]]
    assert curve_sizes(3) == [1, 2, 3]
    assert curve_sizes(20) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 18, 20]


def test_the_induction_circuit_is_found(inspector) -> None:
    """Only L0H0 -> L1H0 (keys), the embeddings -> L0H0 (values: the changed tokens L0H0 copies) and L1H0 -> the
    logits score above the threshold (a quarter of the gap); everything else is below 0.2 of the gap."""
    register_model("circuit-edges", induction_circuit(), circuit_tokenizer())
    report = get_tool("find_circuit")(
        inspector, {"model": "circuit-edges", "clean": CLEAN, "corrupted": CORRUPTED, "detail": "full"}
    )
    listed = {(e.sender, e.receiver, e.kind) for e in report.edges}
    assert listed == {("L0H0", "L1H0", "K"), ("embeddings", "L0H0", "V"), ("L1H0", "logits", "direct")}
    assert report.threshold == 0.25 and all(e.score > 0.25 for e in report.edges)
    assert report.edges[0].sender == "L0H0" and report.edges[0].kind == "K"
    assert "L1H0 reads L0H0's output through its keys (K-composition)" in report.edges[0].sentence
    assert report.answer == " dog" or report.answer.strip() == "dog"
    # exact edge patching: the circuit is the three edges together (the K edge alone leaves L1H0's output
    # corrupted where the logits read it; without the embeddings' V edge L0H0 writes the corrupted previous token)
    assert report.faithfulness_method.startswith("edge-level (exact edge patching)")
    assert report.reached and report.circuit_edges == 3 and report.faithfulness == pytest.approx(1.0, abs=1e-3)
    assert all(e.in_circuit for e in report.edges)
    assert [p.faithfulness for p in report.curve[:3]] == pytest.approx([0.0, 0.0, 1.0], abs=1e-3)
    assert report.curve[2].heads == 2
    assert report.empty_circuit == pytest.approx(0.0, abs=1e-3)
    assert report.curve[-1].edges == report.edges_scored and report.curve[-1].faithfulness == pytest.approx(1.0)
    assert report.curve[2].random_mean == pytest.approx(0.0, abs=1e-3)  # 5 random sets of 3 edges restore nothing
    assert report.steps == 5


def test_the_runner_scores_nothing_else_above_a_fifth_of_the_gap(inspector) -> None:
    loaded = register_model("circuit-edges-raw", induction_circuit(), circuit_tokenizer())
    clean, corrupted = inspector.encode(loaded, CLEAN), inspector.encode(loaded, CORRUPTED)
    a, w = (loaded.tokenizer.convert_tokens_to_ids(t) for t in ("dog", "moon"))
    passes = inspector.edge_attribution(loaded, clean, corrupted, lambda _c, x: x[:, a] - x[:, w], steps=5)
    gap = float(
        (passes.clean_logits[a] - passes.clean_logits[w]) - (passes.corrupted_logits[a] - passes.corrupted_logits[w])
    )
    shares = (passes.scores / gap).abs()
    big = {(passes.senders[s], passes.receivers[r].kind) for s, r in (shares > 0.2).nonzero().tolist()}
    assert big == {((0, 0), "K"), ((-1, -1), "V"), ((1, 0), "direct")}
    assert not passes.valid[1 + 0 * 4 + 0, 0]  # a layer-0 head cannot send to a layer-0 receiver


def test_bad_input_is_refused(inspector) -> None:
    register_model("circuit-edges-bad", induction_circuit(), circuit_tokenizer())
    tool = get_tool("find_circuit")
    with pytest.raises(InvalidInputError, match=r"clean is 6 tokens and corrupted is 5 tokens.*same number of tokens"):
        tool(inspector, {"model": "circuit-edges-bad", "clean": CLEAN, "corrupted": "sun dog cat moon"})
    with pytest.raises(InvalidInputError, match=r"answer 'dog cat' is 2 tokens"):
        tool(inspector, {"model": "circuit-edges-bad", "clean": CLEAN, "corrupted": CORRUPTED, "answer": "dog cat"})
    model = induction_circuit()
    table = model.transformer.wte.weight.detach()
    model.transformer.wte.weight = torch.nn.Parameter((table * 100).round().to(torch.int8), requires_grad=False)
    register_model("circuit-edges-int8", model, circuit_tokenizer())
    with pytest.raises(InvalidInputError, match=r"no floating-point embedding table \(quantized or missing\)"):
        tool(inspector, {"model": "circuit-edges-int8", "clean": CLEAN, "corrupted": CORRUPTED})


def test_grouped_query_receivers_are_kv_heads(tiny_models, inspector) -> None:
    """The tiny Llama has 4 query heads sharing 2 KV heads: Q receivers per query head, K/V per KV head."""
    loaded = tiny_models["llama"]
    facts = loaded.facts
    clean, corrupted = (
        inspector.encode(loaded, "the cat sat on the mat"),
        inspector.encode(loaded, "the cat sat on the dog"),
    )
    passes = inspector.edge_attribution(loaded, clean, corrupted, lambda _c, x: x[:, 5] - x[:, 6], steps=2)
    kinds = [r.kind for r in passes.receivers]
    per_layer = facts.num_heads + 2 * facts.num_kv_heads
    assert len(passes.receivers) == facts.num_layers * per_layer + 1 and kinds[-1] == "direct"
    assert kinds.count("K") == kinds.count("V") == facts.num_layers * facts.num_kv_heads
    assert len(passes.senders) == 1 + facts.num_layers * facts.num_heads
    assert torch.isfinite(passes.scores).all() and passes.scores[~passes.valid].abs().sum() == 0
    # the logits read only the last position: the embeddings' direct edge is nonzero when the last token differs,
    # and exactly 0 when only an earlier one does
    assert abs(float(passes.scores[0, -1])) > 0
    earlier = inspector.encode(loaded, "the dog sat on the mat")
    again = inspector.edge_attribution(
        loaded, inspector.encode(loaded, "the cat sat on the mat"), earlier, lambda _c, x: x[:, 5] - x[:, 6], steps=2
    )
    assert float(again.scores[0, -1]) == 0.0


def test_the_receivers_split_the_whole_gradient(inspector) -> None:
    """The hand-set circuit has no MLP, so the gradient at the embeddings' residual is the sum of every receiver's
    (each head's Q, K and V read, and the logits'): the embeddings' edge scores summed over every receiver equal
    Δembedding · ∂M/∂residual from a plain autograd run at the one interpolation point (steps=1: α = ½)."""
    model = induction_circuit()
    loaded = register_model("circuit-edges-sum", model, circuit_tokenizer())
    clean, corrupted = inspector.encode(loaded, CLEAN), inspector.encode(loaded, CORRUPTED)
    a, w = (loaded.tokenizer.convert_tokens_to_ids(t) for t in ("dog", "moon"))
    passes = inspector.edge_attribution(loaded, clean, corrupted, lambda _c, x: x[:, a] - x[:, w], steps=1)
    wte = model.transformer.wte
    with torch.no_grad():
        delta = (wte(clean.input_ids) - wte(corrupted.input_ids)).double()
    embeds = (0.5 * (wte(clean.input_ids) + wte(corrupted.input_ids))).detach().requires_grad_(True)
    out = model(inputs_embeds=embeds, output_hidden_states=True)
    residual = out.hidden_states[0]
    (grad,) = torch.autograd.grad(out.logits[0, -1, a] - out.logits[0, -1, w], residual)
    expected = float((delta * grad.double()).sum())
    assert abs(expected) > 1.0
    assert float(passes.scores[0].sum()) == pytest.approx(expected, rel=1e-4)


def test_a_pass_over_the_memory_budget_is_refused_before_it_runs() -> None:
    from agent_tools.errors import ResourceLimitError
    from agent_tools.inspector import Inspector

    register_model("circuit-edges-budget", induction_circuit(), circuit_tokenizer())
    small = Inspector(memory_budget=10_000)
    with pytest.raises(ResourceLimitError, match=r"5 interpolation steps would hold about .* use fewer steps"):
        get_tool("find_circuit")(small, {"model": "circuit-edges-budget", "clean": CLEAN, "corrupted": CORRUPTED})


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3"])
def test_exact_edge_patching_matches_the_runs_it_must_reproduce(tiny_models, inspector, family) -> None:
    """Every edge clean gives the clean run, no edge the corrupted run, and every edge among a node set (with the
    embeddings) gives node-level patching of the same heads: the heads outside corrupted, MLPs reading the rest."""
    loaded = tiny_models[family]
    facts = loaded.facts
    clean, corrupted = (inspector.encode(loaded, t) for t in ("the cat sat on the mat", "the dog sat on the mat"))
    passes = inspector.edge_attribution(loaded, clean, corrupted, lambda _c, x: x[:, 5] - x[:, 6], steps=1)
    every = [(s, r) for s, r in passes.valid.nonzero().tolist()]
    kept = {(0, 1), (1, 0), (facts.num_layers - 1, facts.num_heads - 1)}
    groups = facts.num_heads // facts.num_kv_heads

    def reads_from(r: int) -> set[tuple[int, int]]:
        receiver = passes.receivers[r]
        if receiver.kind == "direct":
            return set()
        if receiver.kind == "Q":
            return {(receiver.layer, receiver.head)}
        return {(receiver.layer, receiver.head * groups + g) for g in range(groups)}

    def inside(s: int, r: int) -> bool:
        sender_ok = passes.senders[s] == (-1, -1) or passes.senders[s] in kept
        receiver = passes.receivers[r]
        return sender_ok and (receiver.kind == "direct" or bool(reads_from(r) & kept))

    among = [(s, r) for s, r in every if inside(s, r)]
    node_senders = {0} | {1 + layer * facts.num_heads + head for layer, head in kept}
    everything = set(range(len(passes.senders)))
    sets, nodes = [every, [], among], [everything, set(), node_senders]
    logits = inspector.edge_patched_logits(loaded, clean, passes, sets, nodes, readout=_whole)[0][:, -1]  # (3, V)
    assert torch.allclose(logits[0], passes.clean_logits, atol=1e-5)
    assert torch.allclose(logits[1], passes.corrupted_logits, atol=1e-5)
    # node-level reference (K/V receivers shared by a kept and a corrupted head read clean only for the kept head)
    if groups == 1:
        rest = sorted((layer, head) for layer in range(facts.num_layers) for head in range(facts.num_heads))
        rest = [x for x in rest if x not in kept]
        patch = HeadPatch(
            rest[0][0],
            tuple(h for layer, h in rest if layer == rest[0][0]),
            also=tuple(x for x in rest if x[0] != rest[0][0]),
        )
        node = inspector.patched_outputs(loaded, clean, [patch], readout=_whole, sources=passes.corrupted_heads)[0][
            0, -1
        ]
        assert torch.allclose(logits[2], node, atol=1e-5)
    assert not torch.allclose(logits[2], passes.clean_logits, atol=1e-3)


def test_a_block_that_normalises_head_outputs_falls_back_to_node_level(tiny_models, inspector) -> None:
    """Gemma 2 normalises the attention output before adding it (post_attention_layernorm): a head's write is not
    a W_O slice, so edge patching is refused and the report says it measured node-level faithfulness, and why."""
    report = get_tool("find_circuit")(
        inspector,
        {
            "model": "tiny-gemma2",
            "clean": "the cat sat on the mat",
            "corrupted": "the dog sat on the mat",
            "answer": "dog",
            "wrong": "the",
        },
    )
    assert report.faithfulness_method.startswith("node-level")
    assert "post_attention_layernorm" in report.faithfulness_method


def test_the_circuit_is_drawn_as_png_and_svg_page(inspector) -> None:
    """png: a PNG and a standalone HTML page (inline SVG, no script) whose edges carry their sentences."""
    from pathlib import Path

    register_model("circuit-edges-picture", induction_circuit(), circuit_tokenizer())
    report = get_tool("find_circuit")(
        inspector, {"model": "circuit-edges-picture", "clean": CLEAN, "corrupted": CORRUPTED, "png": True}
    )
    assert report.png_path is not None and report.html_path is not None
    assert Path(report.png_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = Path(report.html_path).read_text()
    assert "<svg" in page and "<script" not in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    assert page.count('<g class="edge">') == 3 and page.count('<g class="node">') == 4
    for edge in report.edges:
        assert f"<title>{edge.sentence}</title>" in page.replace("&#x27;", "'")
    assert 'stroke="#e8590c"' in page  # the K-composition edge in the keys' colour


def _trained_induction_model(steps: int = 150) -> tuple[torch.nn.Module, float]:
    """The hand-set two-layer model with L1H0's query and key weights replaced by random ones and trained (Adam,
    ``steps`` batches of 32 induction sequences ``<bos> x1 … x6 xj`` -> ``x(j+1)``, seeded): the first step (L0H0,
    previous-token head) and L1H0's copy (OV) are planted; the second step's match must be learned. Returns the
    model and its accuracy on 512 fresh sequences."""
    from crafted import CIRCUIT_HEAD_DIM, CIRCUIT_HIDDEN

    torch.manual_seed(0)
    model = induction_circuit()
    weight = model.transformer.h[1].attn.c_attn.weight  # (C, 3C): q | k | v, head 0 first in each
    trained = torch.zeros(3 * CIRCUIT_HIDDEN, dtype=torch.bool)
    trained[:CIRCUIT_HEAD_DIM] = trained[CIRCUIT_HIDDEN : CIRCUIT_HIDDEN + CIRCUIT_HEAD_DIM] = True
    with torch.no_grad():
        weight[:, trained] = 0.05 * torch.randn(CIRCUIT_HIDDEN, 2 * CIRCUIT_HEAD_DIM)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    weight.requires_grad_(True)
    optimiser = torch.optim.Adam([weight], lr=2e-2)
    generator = torch.Generator().manual_seed(0)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        words = torch.rand(n, 28, generator=generator).argsort(1)[:, :6] + 4  # 6 distinct words (ids 4..31)
        j = torch.randint(0, 5, (n,), generator=generator)
        ids = torch.cat([torch.zeros(n, 1, dtype=torch.long), words, words.gather(1, j[:, None])], 1)
        return ids, words.gather(1, (j + 1)[:, None])[:, 0]

    for _ in range(steps):
        ids, target = batch(32)
        loss = torch.nn.functional.cross_entropy(model(input_ids=ids, logits_to_keep=1).logits[:, -1], target)
        optimiser.zero_grad()
        loss.backward()
        weight.grad[:, ~trained] = 0  # type: ignore[index]
        optimiser.step()
    weight.requires_grad_(False)
    ids, target = batch(512)
    with torch.no_grad():
        accuracy = float((model(input_ids=ids).logits[:, -1].argmax(-1) == target).float().mean())
    return model, accuracy


@pytest.mark.slow
def test_a_trained_two_step_circuit_is_recovered(inspector) -> None:
    """After 150 training steps L1H0 has learned to match the current token against L0H0's previous-token write
    (K-composition); find_circuit recovers exactly the planted path — the embeddings -> L0H0 (values), L0H0 ->
    L1H0 (keys), L1H0 -> the logits — as the smallest edge set reaching the target, faithfulness ≥ 0.9 by exact
    edge patching, no other edge above the threshold, on two pairs."""
    model, accuracy = _trained_induction_model()
    assert accuracy >= 0.95
    register_model("circuit-trained", model, circuit_tokenizer())
    planted = {("embeddings", "L0H0", "V"), ("L0H0", "L1H0", "K"), ("L1H0", "logits", "direct")}
    pairs = [(CLEAN, CORRUPTED), ("red one blue two green three blue", "blue one red two green three blue")]
    for clean, corrupted in pairs:
        report = get_tool("find_circuit")(
            inspector, {"model": "circuit-trained", "clean": clean, "corrupted": corrupted, "detail": "full"}
        )
        assert report.faithfulness_method.startswith("edge-level")
        assert report.reached and report.circuit_edges == 3 and report.faithfulness >= 0.9
        assert {(e.sender, e.receiver, e.kind) for e in report.edges if e.in_circuit} == planted
        assert {(e.sender, e.receiver, e.kind) for e in report.edges} == planted  # nothing else ≥ 0.25 of the gap
        assert report.empty_circuit == pytest.approx(0.0, abs=1e-3)
        assert report.curve[2].random_mean <= 0.2  # 5 random sets of 3 edges


def test_the_path_order_adds_whole_paths_from_the_embeddings_to_the_logits() -> None:
    """Two layers of two heads. By score: L1H0 -> logits 0.9, a decoy L0H0 -> L1H1 (V) 0.8 (L1H1 reaches the logits
    by no edge toward the answer), L0H1 -> L1H0 (K) 0.6, embeddings -> L1H0 (Q) 0.5, embeddings -> L0H1 (V) 0.4,
    and L0H0 -> L1H0 (V) -0.7 (against the answer). The embeddings' best edge first (Q), then from the logits:
    L1H0's direct edge, the K edge into L1H0, the V edge into L0H1; the decoy (into no head joined to the logits)
    and the negative edge come after, by |score|."""
    from types import SimpleNamespace

    from agent_tools.families import KvGrouping
    from agent_tools.runner.edge_attribution import EMBEDDINGS, Receiver
    from agent_tools.tools.find_circuit.plan import _path_order

    class Facts(KvGrouping):  # two query heads, each its own KV head
        num_heads, num_kv_heads = 2, 2

    loaded = SimpleNamespace(facts=Facts())
    senders = [EMBEDDINGS, (0, 0), (0, 1), (1, 0), (1, 1)]
    receivers = [Receiver(layer, head, kind) for layer in (0, 1) for head in (0, 1) for kind in "QKV"]
    receivers.append(Receiver(2, -1, "direct"))
    index = {(r.layer, r.head, r.kind): i for i, r in enumerate(receivers)}
    shares = torch.zeros(len(senders), len(receivers))
    direct, decoy = (3, index[(2, -1, "direct")]), (1, index[(1, 1, "V")])
    k_edge, q_edge, v_edge = (2, index[(1, 0, "K")]), (0, index[(1, 0, "Q")]), (0, index[(0, 1, "V")])
    against = (1, index[(1, 0, "V")])
    for edge, value in [(direct, 0.9), (decoy, 0.8), (against, -0.7), (k_edge, 0.6), (q_edge, 0.5), (v_edge, 0.4)]:
        shares[edge] = value
    every = [direct, decoy, against, k_edge, q_edge, v_edge]
    passes = SimpleNamespace(senders=senders, receivers=receivers)
    assert _path_order(loaded, passes, shares, every, 6) == [q_edge, direct, k_edge, v_edge, decoy, against]  # type: ignore[arg-type]
    assert _path_order(loaded, passes, shares, every, 3) == [q_edge, direct, k_edge]  # type: ignore[arg-type]
