"""Evidence beside attention: the pure measures by hand, the batched runners against one-at-a-time forwards, and
the prompt trace's causal / gradient / value checks — on a tiny model trained here to retrieve past a distractor
whose answer is known, and on bad input."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from crafted import retrieval_model, retrieval_tokenizer

from agent_tools.analysis.attribution import (
    answer_logprobs,
    average_ranks,
    content_shares,
    filler_positions,
    frozen_norm_map,
    logprob_changes,
    norm_scale,
    rank_agreement,
    relative_value_norms,
    restored_fraction,
    spearman,
    value_weighted_rows,
)
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel, register_model
from agent_tools.runner import attribution as attribution_runner
from agent_tools.runner.attribution import SegmentVariant, direct_logits
from agent_tools.runner.patching import HeadPatch, patched_outputs, recorded_run
from agent_tools.session import guarded
from agent_tools.tools import get_tool

TEXT = "the cat sat on the mat because it was tired and the dog"
DISTRACTOR = "the . , the and of the . , the a of and the , . the of a . , and the of , the and"
FACT = "code is 7"


# --- pure measures, by hand ----------------------------------------------------------------------------------------
def test_ranks_and_spearman_by_hand() -> None:
    assert average_ranks([3.0, 1.0, 1.0, 2.0]) == [1.0, 3.5, 3.5, 2.0]
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # ranks [2.5, 2.5, 1] and [3, 2, 1]: centred (.5, .5, −1), (1, 0, −1): 1.5 / sqrt(1.5 · 2)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(1.5 / math.sqrt(3.0))
    assert spearman([1.0], [2.0]) is None and spearman([1, 1], [1, 2]) is None
    rows = rank_agreement({"attention": [0.5, 0.3, 0.2], "causal": [0.1, 2.0, 0.0], "gradient": [0.2, 1.0, -0.1]})
    assert [(a, b, same) for a, b, _, same in rows] == [
        ("attention", "causal", False),
        ("attention", "gradient", False),
        ("causal", "gradient", True),
    ]
    assert rows[2][2] == pytest.approx(1.0) and rows[0][2] == pytest.approx(0.5)


def _whole(output: torch.Tensor) -> tuple[torch.Tensor]:
    """A readout that keeps every row's whole output (tiny models only: the tests compare full logits)."""
    return (output.float(),)


def test_logprobs_changes_and_restored_fraction_by_hand() -> None:
    logits = torch.zeros(2, 2, 4)
    logits[1, 0, 2] = math.log(3.0)  # row 1, first answer position: p(token 2) = 3 / 6
    answer = torch.tensor([2, 1])
    logprobs = answer_logprobs(logits, answer)
    assert logprobs.flatten().tolist() == pytest.approx([math.log(0.25)] * 2 + [math.log(0.5), math.log(0.25)])
    first, whole = logprob_changes(logprobs[1:], logprobs[0])
    assert first.tolist() == pytest.approx([math.log(2.0)]) and whole.tolist() == pytest.approx([math.log(2.0)])
    assert restored_fraction(torch.tensor([-1.0, 0.0, 1.0, 3.0]), 1.0, -1.0).tolist() == [0.0, 0.5, 1.0, 2.0]


@pytest.mark.parametrize("centred", [True, False])
def test_frozen_norm_map_is_the_norm_with_its_scale_held(centred: bool) -> None:
    torch.manual_seed(0)
    gain, bias, eps = torch.randn(6).double(), torch.randn(6).double() * centred, 1e-5
    vectors = torch.randn(4, 6).double()

    def norm(v: torch.Tensor) -> torch.Tensor:  # the module: g ⊙ P(v) / σ(v) + β
        z = v - v.mean(-1, keepdim=True) if centred else v
        return gain * z / norm_scale(v, centred=centred, eps=eps)[:, None] + bias

    inputs = torch.cat([torch.zeros(1, 6).double(), vectors])
    outputs = norm(inputs)
    scale = torch.tensor(1.7).double()
    frozen = frozen_norm_map(outputs, inputs, outputs[0], centred=centred, eps=eps, scale=scale)[1:]
    projected = vectors - vectors.mean(-1, keepdim=True) if centred else vectors
    assert torch.allclose(frozen, gain * projected / 1.7, atol=1e-12)
    assert torch.allclose(
        frozen[0] + frozen[1],
        frozen_norm_map(
            norm(vectors[:2].sum(0, keepdim=True)),
            vectors[:2].sum(0, keepdim=True),
            outputs[0],
            centred=centred,
            eps=eps,
            scale=scale,
        )[0],
        atol=1e-12,
    )  # linear: what two components write adds up


def test_value_weighted_rows_filler_and_content_shares_by_hand() -> None:
    weights = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
    norms = torch.tensor([[1.0, 3.0, 2.0], [1.0, 1.0, 1.0]])
    assert value_weighted_rows(weights, norms).tolist() == [[0.25, 0.75, 0.0], [0.0, 0.0, 0.0]]
    layer_norms = torch.tensor([[1.0, 2.0, 4.0, 0.5], [2.0, 2.0, 2.0, 1.0]])  # medians over tokens 1..3: 2 and 2
    relative = relative_value_norms(layer_norms, torch.tensor([False, True, True, True]))
    assert relative.tolist() == pytest.approx([0.75, 1.0, 1.5, 0.375])
    ratio = torch.tensor([5.0, 3.0, 3.0, 3.0])
    readers = torch.tensor([9.0, 8.0, 8.0, 3.0])
    candidates = torch.tensor([False, True, True, True])
    # token 1 writes the median (1.0 > 0.9), token 2 more, token 3 little but only 3 readers: none qualifies
    assert filler_positions(ratio, readers, relative, candidates) == []
    assert filler_positions(ratio, readers, torch.tensor([0.1, 0.8, 1.5, 0.3]), candidates) == [1]
    tokens = torch.tensor([0.4, 0.3, 0.2, 0.1])
    shares = content_shares(tokens, torch.tensor([0, 1, 1, 2]), 3, torch.tensor([True, False, True, False]))
    assert shares.tolist() == pytest.approx([0.0, 0.75, 0.25])


# --- the runners: batched equals one at a time ------------------------------------------------------------------
def _full_logprobs(loaded: LoadedModel, ids: list[int], answer: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([ids + answer[:-1]])).logits  # type: ignore[operator]
    return answer_logprobs(logits[:, len(ids) - 1 : len(ids) - 1 + len(answer)], torch.tensor(answer))[0]


@pytest.mark.parametrize("batched", [False, True])  # one row at a time (CPU), or the padded pair (accelerators)
@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral"])  # mistral: sliding window, no prefix cache
def test_segment_ablations_equal_separate_forwards(
    family: str, batched: bool, tiny_models, inspector: Inspector, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attribution_runner, "batches_rows", lambda loaded: batched)
    loaded = tiny_models[family]
    prompt = inspector.encode(loaded, TEXT).input_ids[0].tolist()
    answer = [8, 9, 10]
    spans = [(1, 4), (5, 9), (9, 14), (13, 14)]  # the last removes the prompt's last token
    variants = [SegmentVariant(s, prompt[:s] + prompt[e:], prompt[:s] + [12] * (e - s) + prompt[e:]) for s, e in spans]
    with guarded(loaded):
        found = attribution_runner.segment_ablations(loaded, prompt, answer, variants)
    assert torch.allclose(found.clean, _full_logprobs(loaded, prompt, answer), atol=1e-5)
    for row, variant in enumerate(variants):
        assert torch.allclose(found.removed[row], _full_logprobs(loaded, variant.removed, answer), atol=1e-5)
        assert torch.allclose(found.neutral[row], _full_logprobs(loaded, variant.neutral, answer), atol=1e-5)
    # starting from the traced (captured) pass's KV cache gives the same numbers
    traced = inspector.traced_answer(loaded, inspector.encode(loaded, TEXT))
    with guarded(loaded):
        reused = attribution_runner.segment_ablations(loaded, prompt, answer, variants, traced=traced)
    for name in ("clean", "removed", "neutral"):
        assert torch.allclose(getattr(reused, name), getattr(found, name), atol=1e-5), name


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_batched_patches_equal_single_patched_forwards(family: str, tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models[family]
    clean = inspector.encode(loaded, "the cat sat on the mat because it")
    corrupted = inspector.encode(loaded, "the cat sat on the dog because it")  # differs from position 6 on
    source = recorded_run(loaded, clean.input_ids).heads
    patches = [HeadPatch(1, (2,)), HeadPatch(0, (0, 3)), HeadPatch(1, (1,), (7,)), HeadPatch(0, (1,), (6, 8))]
    batched = inspector.patched_outputs(loaded, corrupted, patches, readout=_whole, sources=source, prefix=6)[0]
    for row, patch in enumerate(patches):
        single = patched_outputs(loaded, corrupted.input_ids, [patch], readout=_whole, sources=source)[
            0
        ]  # one row, no prefix
        assert torch.allclose(batched[row], single[0], atol=1e-4)
    # zero ablation through the same rows equals ablate's heads_ablated
    ablated = inspector.ablate(loaded, corrupted.input_ids, None, [(1, 2)])
    zeroed = inspector.patched_outputs(loaded, corrupted, [HeadPatch(1, (2,))], readout=_whole, keep_last=False)[0]
    assert torch.allclose(zeroed[0], ablated.ablated[0], atol=1e-4)


def test_direct_logits_match_a_weight_reading_reference(tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models["llama"]  # RMSNorm: DLA_h = W_U[t] · (γ ⊙ W_O^h z_h) / σ
    encoded = inspector.encode(loaded, TEXT)
    model, facts = loaded.model, loaded.facts
    heads = recorded_run(loaded, encoded.input_ids).heads
    token = 17
    found = direct_logits(loaded, encoded.input_ids, token)
    norm = model.model.norm  # type: ignore[union-attr]
    residual = _final_residual(model, encoded.input_ids)
    sigma = norm_scale(residual, centred=False, eps=norm.variance_epsilon)
    for layer in range(facts.num_layers):
        o_proj = model.model.layers[layer].self_attn.o_proj  # type: ignore[union-attr,index]
        for head in range(facts.num_heads):
            z = heads[layer][-1, head].double()
            write = o_proj.weight.double()[:, head * facts.head_dim : (head + 1) * facts.head_dim] @ z
            expected = model.lm_head.weight.double()[token] @ (norm.weight.double() * write / sigma)  # type: ignore[union-attr]
            assert float(found.heads[layer, head]) == pytest.approx(float(expected), abs=1e-5)
    assert found.norm == "rms_norm" and found.scale == pytest.approx(float(sigma), rel=1e-6)


def _final_residual(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The last position's input to the final norm."""
    kept: dict[str, torch.Tensor] = {}

    def keep(module: torch.nn.Module, args: tuple) -> None:
        kept["x"] = args[0][0, -1].double()

    handle = model.model.norm.register_forward_pre_hook(keep)  # type: ignore[union-attr]
    try:
        with torch.inference_mode():
            model(input_ids=ids)
    finally:
        handle.remove()
    return kept["x"]


# --- the prompt trace's checks ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def retrieval() -> LoadedModel:
    """The tiny retrieval model, trained here (seconds), registered as ``tiny-retrieval``."""
    return register_model("tiny-retrieval", retrieval_model(), retrieval_tokenizer())


def _retrieval_trace(inspector: Inspector, **extra) -> object:
    arguments = {
        "model": "tiny-retrieval",
        "prompt": [{"role": "user", "content": f"{DISTRACTOR} {FACT}"}],
        "segments": [{"name": "distractor", "text": DISTRACTOR}, {"name": "fact", "text": FACT}],
        "neutral_token": ".",
        **extra,
    }
    return get_tool("trace_prompt_attention")(inspector, arguments)


def test_known_answer_causal_and_gradient_rank_the_fact_first_where_attention_does_not(
    retrieval: LoadedModel, inspector: Inspector
) -> None:
    report = _retrieval_trace(inspector, checks=["causal", "gradient", "value"], ig_steps=64)
    segments = {s.name: s for s in report.segments}
    distractor, fact = segments["distractor"], segments["fact"]
    assert report.next_tokens[0].token == "7" and report.answer_evidence.text == "7"
    # attention reads the long distractor most; the answer depends on the three-token fact
    assert report.read_most == "distractor" and distractor.share > fact.share
    assert report.depends_on_most == "fact" and report.measures_agree is False
    # one sign convention: Δ log p(answer) when removed; the fact's removal lowers it, the distractor's barely moves it
    assert fact.causal.removed < -5 and abs(distractor.causal.removed) < 0.5
    assert fact.causal.direction == "depends_on" and fact.causal.removed == fact.causal.answer_removed
    assert fact.causal.top_token_changed_removed and not distractor.causal.top_token_changed_removed
    assert fact.gradient.integrated_gradients > distractor.gradient.integrated_gradients
    # completeness: the segments' IG add up to log p(input) − log p(baseline), up to the reported delta
    run = report.gradient_run
    total = sum(s.gradient.integrated_gradients for s in report.segments if s.gradient)
    assert total - (run.value - run.baseline_value) == pytest.approx(run.delta, abs=2e-3)
    attention_causal = next(a for a in report.agreement if {a.measure_a, a.measure_b} == {"attention", "causal"})
    assert attention_causal.spearman == pytest.approx(-1.0) and not attention_causal.same_top
    assert report.summary.startswith("Measured answer '7': one token: the model's most likely next token '7'")
    assert f"'7' depends on 'fact' (removing it lowers log p by {-fact.causal.removed:.2f})" in report.summary
    assert "They disagree: removal moves 'fact' most, attention ranks it 2 of 2" in report.summary
    assert "Integrated gradients (an approximation of removal, whole answer) put 'fact' first" in report.summary
    assert "independent" not in report.summary
    assert {v.view for v in report.views} == {"share", "last_layer", "rollout", "value", "causal", "gradient"}
    assert {f.kind for f in report.findings} >= {"depends_on", "rank_agreement"}
    assert report.checks == ["causal", "gradient", "value"] and report.neutral_token == "."
    # the distractor's share against uniform attention: its 27 tokens of the prompt's 33 (<bos>, fact, "code ?")
    assert report.num_tokens == 33 and distractor.token_count == len(DISTRACTOR.split()) == 27
    assert distractor.uniform_share == pytest.approx(27 / 33, abs=1e-4)
    call = next(c for c in report.next_calls if c.tool == "compare_prompts")
    assert call.arguments["prompt_b"] == [{"role": "user", "content": DISTRACTOR + " "}]  # exactly the fact cut out


def test_default_checks_skip_a_whole_prompt_segment_and_explicit_ones_refuse_it(
    tiny_models, inspector: Inspector
) -> None:
    loaded = tiny_models["llama"]
    report = get_tool("trace_prompt_attention")(inspector, {"model": "tiny-llama", "prompt": TEXT})
    assert report.checks == ["value"] and report.depends_on_most is None
    assert any("covers the whole prompt" in note for note in report.evidence_notes)
    assert all(s.causal is None for s in report.segments)
    with pytest.raises(InvalidInputError, match=r"segment 'text' covers the whole prompt \(positions 1\.\.13\)"):
        get_tool("trace_prompt_attention")(inspector, {"model": "tiny-llama", "prompt": TEXT, "checks": ["causal"]})
    assert loaded.facts.is_language_model


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"neutral_token": "the cat"}, r"neutral_token 'the cat' is 2 tokens .* give text that is exactly one token"),
        ({"checks": ["causal", "causal"]}, r"checks lists a check twice; give each of causal, gradient, value"),
        ({"answer": " "}, r"answer produced no tokens"),
    ],
)
def test_bad_evidence_arguments(extra: dict, message: str, tiny_models, inspector: Inspector) -> None:
    arguments = {"model": "tiny-llama", "prompt": TEXT, "segments": [{"name": "a", "text": "the cat sat"}], **extra}
    with pytest.raises(InvalidInputError, match=message):
        get_tool("trace_prompt_attention")(inspector, arguments)


def test_gradient_check_refuses_a_model_without_gradients_to_its_embeddings(tiny_models, inspector: Inspector) -> None:
    model = copy.deepcopy(tiny_models["llama"].model)
    model.model.norm.register_forward_hook(lambda module, args, output: output.detach())  # type: ignore[union-attr]
    register_model("tiny-detached", model, tiny_models["llama"].tokenizer)
    arguments = {
        "model": "tiny-detached",
        "prompt": TEXT,
        "segments": [{"name": "a", "text": "the cat sat"}],
        "checks": ["gradient"],
        "ig_steps": 4,
    }
    with pytest.raises(InvalidInputError, match=r"no gradient reaches the input embeddings of 'tiny-detached'"):
        get_tool("trace_prompt_attention")(inspector, arguments)


def test_given_answer_is_teacher_forced_and_compare_prompts_reports_effects(tiny_models, inspector: Inspector) -> None:
    segments = [{"name": "a", "text": "the cat sat"}]
    arguments = {"model": "tiny-llama", "prompt": TEXT, "segments": segments, "answer": "was tired"}
    report = get_tool("trace_prompt_attention")(inspector, arguments)
    evidence = report.answer_evidence
    assert evidence.source == "given" and evidence.tokens == ["was", "tired"] and len(evidence.token_ids) == 2
    loaded = tiny_models["llama"]
    expected = _full_logprobs(loaded, inspector.encode(loaded, TEXT).input_ids[0].tolist(), evidence.token_ids)
    assert evidence.logprob == pytest.approx(float(expected.sum()), abs=1e-4)
    a = {s.name: s for s in report.segments}["a"]
    assert a.causal.answer_removed != a.causal.first_token_removed  # two answer tokens: the sum differs
    comparison = get_tool("compare_prompts")(
        inspector,
        {
            "model": "tiny-llama",
            "prompt_a": TEXT,
            "prompt_b": TEXT.replace("cat", "dog"),
            "segments_a": segments,
            "segments_b": [{"name": "a", "text": "the dog sat"}],
        },
    )
    row = next(r for r in comparison.segments if r.name == "a")
    assert row.removed_a == comparison.trace_a.segments[1].causal.removed and row.removed_b is not None
    assert comparison.next_calls and all(c.tool == "trace_prompt_attention" for c in comparison.next_calls)


@pytest.mark.real_model
def test_filler_is_set_apart_on_the_default_model(smol, inspector: Inspector) -> None:
    docs = [
        "The Eiffel Tower is located in Paris. It was completed in 1889 and is 330 metres tall.",
        "Bananas are a good source of potassium. The plant is a large herb and the fruit grows in clusters.",
        "The capital of Australia is Canberra, which was chosen as a compromise between Sydney and Melbourne.",
        "Photosynthesis converts light into chemical energy. It takes place in the chloroplasts of the cell.",
    ]
    question = "Question: What is the capital of Australia? Answer in one word."
    messages = [
        {"role": "system", "content": "Answer using the documents."},
        {"role": "user", "content": "\n\n".join(docs) + "\n\n" + question},
    ]
    segments = [{"name": f"doc{i + 1}", "text": d} for i, d in enumerate(docs)]
    report = get_tool("trace_prompt_attention")(
        inspector, {"prompt": messages, "segments": segments, "answer": "Canberra"}
    )
    assert report.filler and all(f.relative_value_norm <= 0.9 and f.received_ratio >= 2 for f in report.filler)
    filler = {f.position for f in report.filler}
    for segment in report.segments:
        assert not filler & {t.position for t in segment.top_tokens} or all(t.filler for t in segment.token_shares)
    # 'Can' 'berra' teacher-forced: the answer depends on the document that holds it; its first token alone does not
    doc3 = next(s for s in report.segments if s.name == "doc3")
    assert report.answer_evidence.tokens == ["Can", "berra"] and report.depends_on_most == "doc3"
    assert doc3.causal.answer_removed < -2 and abs(doc3.causal.first_token_removed) < 1
    assert report.deciding_token.token == "berra" and report.deciding_token.effects[0].segment == "doc3"
    assert report.summary.startswith("Measured answer 'Canberra': the given answer, 2 token(s)")
    assert "Deciding token 'berra' (step 1 of 2" in report.summary


def test_gradient_check_is_refused_over_the_memory_budget_before_any_pass(tiny_models) -> None:
    arguments = {"model": "tiny-llama", "prompt": TEXT, "segments": [{"name": "a", "text": "the cat sat"}]}
    tight = Inspector(memory_budget=20_000)  # holds the rollout (3·14²·4 B), not a backward pass (~70 kB a row)
    with pytest.raises(ResourceLimitError, match=r"a gradient pass over 14 tokens would hold about .* of activations"):
        get_tool("trace_prompt_attention")(tight, {**arguments, "checks": ["gradient"]})
    assert get_tool("trace_prompt_attention")(tight, arguments).checks == ["causal", "value"]


# --- one sign convention, per-token effects, the deciding token -----------------------------------------------------
def test_a_segment_that_suppresses_the_answer_is_said_to_work_against_it(
    retrieval: LoadedModel, inspector: Inspector
) -> None:
    """Two facts, 'code is 3' then 'code is 7'; the model answers '7'. For the given answer '3', the segment holding
    '7' suppresses it: removing it leaves '3' the only fact, so log p('3') must rise (known by construction)."""
    rival, fact = "code is 3", "code is 7"
    arguments = {
        "model": "tiny-retrieval",
        "prompt": [{"role": "user", "content": f"{DISTRACTOR} {rival} {fact}"}],
        "segments": [
            {"name": "distractor", "text": DISTRACTOR},
            {"name": "rival", "text": rival},
            {"name": "fact", "text": fact},
        ],
        "answer": "3 .",  # two tokens: the digit decides, the '.' after it is boilerplate
        "neutral_token": ".",
        "detail": "full",
    }
    report = get_tool("trace_prompt_attention")(inspector, arguments)
    assert report.next_tokens[0].token == "7"
    segments = {s.name: s for s in report.segments}
    prompt_ids = inspector.encode(retrieval, report.rendered_prompt, add_special_tokens=False).input_ids[0].tolist()
    answer = report.answer_evidence.token_ids
    clean = _full_logprobs(retrieval, prompt_ids, answer)
    for name in ("rival", "fact", "distractor"):  # per-token Δ equals removing the segment's tokens by hand
        taken = set(segments[name].positions)
        removed = _full_logprobs(retrieval, [t for p, t in enumerate(prompt_ids) if p not in taken], answer)
        causal = segments[name].causal
        assert causal.per_token_removed == pytest.approx((removed - clean).tolist(), abs=1e-3)
        assert sum(causal.per_token_removed) == pytest.approx(causal.answer_removed, abs=2e-3)
    deciding = report.deciding_token
    assert deciding.step == 0 and deciding.token == "3" and report.answer_evidence.tokens == ["3", "."]
    assert deciding.effects[0].segment == "fact" and deciding.effects[0].direction == "works_against"
    fact_delta = segments["fact"].causal.removed
    assert fact_delta == segments["fact"].causal.per_token_removed[0] and fact_delta > 5
    assert segments["fact"].causal.direction == "works_against" and report.works_against_most == "fact"
    assert report.moves_most == "fact" and report.depends_on_most != "fact"
    assert f"is pulled against by 'fact' (removing it raises log p by {fact_delta:.2f})" in report.summary
    assert "Deciding token '3' (step 0 of 2" in report.summary and "depends on 'fact'" not in report.summary
    assert report.answer_evidence.per_token[0].moved_most_by == "fact"
    finding = next(f for f in report.findings if f.kind == "works_against")
    assert finding.value == pytest.approx(fact_delta) and finding.severity == "high"
    # agreement over the named segments: the same top and ρ ≥ 0.5 (attention reads the distractor most here)
    rho = next(a.spearman for a in report.agreement if (a.measure_a, a.measure_b) == ("attention", "causal"))
    assert report.measures_agree == (report.read_most == "fact" and rho is not None and rho >= 0.5)
    assert report.read_most == "distractor" and report.measures_agree is False
