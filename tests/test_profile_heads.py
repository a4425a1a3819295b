"""Head roles: exact scores on constructed maps and on hand-crafted models, streaming = whole, the tool end to end."""

from __future__ import annotations

import math

import pytest
import torch
from crafted import (
    INDUCTION_HEAD,
    PREVIOUS_HEAD,
    SINK_HEAD,
    circuit_tokenizer,
    crafted_bert,
    crafted_gpt2,
    induction_circuit,
)
from families import FAMILIES, build_family, tiny_tokenizer

from agent_tools.analysis.heads import (
    DEFAULT_THRESHOLDS,
    HEAD_ROLES,
    SequenceLayout,
    classify_head,
    copy_losses,
    is_punctuation,
    top_heads,
)
from agent_tools.capture import capture_attention
from agent_tools.consumers.roles import RoleScoreConsumer, role_scores
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Inspector
from agent_tools.loading import register_model
from agent_tools.tools import get_tool
from agent_tools.tools.profile_heads import HeadProfiles, ProfileHeadsInput

EXACT = 1e-6
CAUSAL_TEXT = "the cat sat on the mat , because it was tired ."  # 13 tokens with <bos>; "," at 7, "." at 12
GPT2_PATTERNS = {0: -1, 1: "sink", 2: 0, 4: -4, 5: -5, 6: -2}  # heads 3 and 7 uniform
BERT_PATTERNS = {0: -1, 1: 1, 2: 0, 3: "sink"}  # heads 4..7 uniform


def one_hot_rows(targets: list[int], length: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(targets), length).float()  # (T, T)


def uniform_causal(length: int) -> torch.Tensor:
    causal = torch.ones(length, length).tril()
    return causal / causal.sum(-1, keepdim=True)


# --- pure scorers on constructed maps -----------------------------------------------------------------------------


def test_scores_on_constructed_causal_maps_are_exact() -> None:
    tokens = ["<bos>", "the", "cat", ",", "sat", "."]
    layout = SequenceLayout.for_text(tokens, [True] + [False] * 5, causal=True)  # skip_queries = 2
    previous = one_hot_rows([0, 0, 1, 2, 3, 4], 6)
    sink = one_hot_rows([0] * 6, 6)
    diagonal = torch.eye(6)
    uniform = uniform_causal(6)
    scores = role_scores(torch.stack([previous, sink, diagonal, uniform]), layout)
    assert set(scores) == {"previous_token", "first_token", "self", "local", "broad", "punctuation"}
    expected = {
        "previous_token": [1, 0, 0, (1 / 3 + 1 / 4 + 1 / 5 + 1 / 6) / 4],
        "first_token": [0, 1, 0, 57 / 240],
        "self": [0, 0, 1, 57 / 240],
        # keys 2..4 back, not key 0: row 2 none (not scored: no local key to read), row 3 {1}, row 4 {1, 2},
        # row 5 {1, 2, 3}
        "local": [0, 0, 0, (1 / 4 + 2 / 5 + 3 / 6) / 3],
        "broad": [0, 0, 0, 1],
        # rows that can see a punctuation key other than themselves: 4 (sees 3) and 5 (sees 3)
        "punctuation": [(1 + 0) / 2, 0, 0, (1 / 5 + 1 / 6) / 2],
    }
    for role, values in expected.items():
        assert scores[role].tolist() == pytest.approx(values, abs=EXACT), role
    verdicts = [classify_head({r: float(v[h]) for r, v in scores.items()}, DEFAULT_THRESHOLDS) for h in range(4)]
    assert [v.primary for v in verdicts] == ["previous_token", "first_token", "self", "broad"]
    assert [v.confidence for v in verdicts] == pytest.approx([1, 1, 1, 1], abs=EXACT)


def test_probe_roles_on_constructed_maps() -> None:
    # [bos] a b c a b c: N = 3, first copy at 1..3, second at 4..6
    layout = SequenceLayout.for_probe(7, start=1, repeat_length=3, causal=True)
    induction = one_hot_rows([0, 0, 0, 0, 2, 3, 4], 7)  # second copy reads i - N + 1
    duplicate = one_hot_rows([0, 0, 0, 0, 1, 2, 3], 7)  # second copy reads i - N
    half = (induction + duplicate) / 2
    scores = role_scores(torch.stack([induction, duplicate, half]), layout, ["induction", "duplicate_token"])
    assert scores["induction"].tolist() == pytest.approx([1, 0, 0.5], abs=EXACT)
    assert scores["duplicate_token"].tolist() == pytest.approx([0, 1, 0.5], abs=EXACT)


def test_bidirectional_next_token_and_special_keys() -> None:
    tokens = ["[CLS]", "a", "b", "[SEP]", "c", "d"]
    layout = SequenceLayout.for_text(tokens, [True, False, False, True, False, False], causal=False)
    assert layout.skip_queries == 0
    uniform = torch.full((6, 6), 1 / 6)
    following = one_hot_rows([1, 2, 3, 4, 5, 5], 6)
    scores = role_scores(torch.stack([uniform, following]), layout)
    assert scores["next_token"].tolist() == pytest.approx([1 / 6, 1], abs=EXACT)  # rows 0..4
    # every row but 3 itself can read the [SEP] at 3; the first token is first_token's, not special_token's
    assert scores["special_token"].tolist() == pytest.approx([1 / 6, 1 / 5], abs=EXACT)
    assert scores["broad"][0] == pytest.approx(1, abs=EXACT)
    assert scores["first_token"][0] == pytest.approx(1 / 6, abs=EXACT)


def test_classification_prefers_a_specific_role_over_the_sink_and_reports_runner_up() -> None:
    scores = {"induction": 0.9, "first_token": 0.97, "previous_token": 0.01, "broad": 0.2}
    verdict = classify_head(scores, DEFAULT_THRESHOLDS)
    assert verdict.primary == "induction" and verdict.runner_up == "first_token"
    assert verdict.confidence == pytest.approx((0.9 - 0.3) / 0.7)
    assert verdict.runner_up_score == pytest.approx(0.97)
    nothing = classify_head({"previous_token": 0.2, "self": 0.1}, DEFAULT_THRESHOLDS)
    assert nothing.primary is None and nothing.confidence == 0 and nothing.best == "self"  # 0.1 vs 0.3 beats 0.2 vs 0.4


def test_punctuation_detection() -> None:
    assert is_punctuation(",") and is_punctuation(" .") and is_punctuation("?!") and is_punctuation("Ġ,")
    assert not is_punctuation("a,") and not is_punctuation(" ") and not is_punctuation("")


def test_copy_losses_hand_computed() -> None:
    ids = torch.tensor([[0, 5, 6, 7, 5, 6, 7]])
    logits = torch.zeros(1, 7, 10)
    logits[0, 4, 6] = logits[0, 5, 7] = 100.0  # the second copy's 6 and 7 are predicted with certainty
    first, second = copy_losses(logits, ids, start=1, repeat_length=3)
    assert first == pytest.approx(math.log(10))
    assert second == pytest.approx(0.0, abs=1e-12)


def test_streaming_chunks_equal_whole_map() -> None:
    model = build_family("llama")
    ids = torch.arange(6, 19)[None]
    tokens = [str(t) for t in ids[0].tolist()]
    layout = SequenceLayout.for_text(tokens, [False] * 13, causal=True, local_window=3)
    whole, chunked = RoleScoreConsumer(layout, HEAD_ROLES, 4), RoleScoreConsumer(layout, HEAD_ROLES, 4)
    maps: list[torch.Tensor] = []

    class Keep:
        accepts_key_prefix = False

        def on_layer(self, layer) -> None:
            maps.append(layer.weights[0].clone())

    with torch.inference_mode():
        with capture_attention(model, [whole, Keep()]):
            model(input_ids=ids)
        with capture_attention(model, [chunked], query_chunk=4):
            model(input_ids=ids)
    for layer, per_role in whole.scores().items():
        direct = role_scores(maps[layer], layout)
        assert set(per_role) == set(direct) == set(chunked.scores()[layer])
        for role, values in per_role.items():
            assert torch.allclose(values, direct[role], atol=1e-6)
            assert torch.allclose(values, chunked.scores()[layer][role], atol=1e-6)
    best = top_heads(whole.scores(), "self", 2)
    assert len(best) == 2 and best[0][2] >= best[1][2]


# --- hand-crafted models through the tool ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def crafted() -> dict[str, str]:
    tokenizer = tiny_tokenizer()
    register_model("crafted-gpt2", crafted_gpt2(GPT2_PATTERNS), tokenizer)
    register_model("crafted-bert", crafted_bert(BERT_PATTERNS), tokenizer)
    return {"causal": "crafted-gpt2", "encoder": "crafted-bert"}


def _scores(report: HeadProfiles, head: int) -> dict[str, float]:
    return next(h.scores for h in report.heads if h.head == head)


def test_crafted_decoder_heads_are_classified_with_exact_scores(crafted, inspector: Inspector) -> None:
    report = get_tool("profile_heads")(
        inspector, {"model": crafted["causal"], "text": CAUSAL_TEXT, "probe_length": 5, "top_k": 2}
    )
    primaries = {h.head: h.primary_role for h in report.heads}
    assert primaries == {
        0: "previous_token",
        1: "first_token",
        2: "self",
        3: "broad",
        4: "induction",
        5: "duplicate_token",
        6: "local",
        7: "broad",
    }
    rows = range(2, 13)  # skip_queries = 2 for a causal model; 11 scored rows (local: rows 3..12 read a local key)
    uniform_previous = sum(1 / (i + 1) for i in rows) / 11
    uniform_local = (1 / 4 + 2 / 5 + sum(3 / (i + 1) for i in range(5, 13))) / 10
    expected = {
        0: {"previous_token": 1, "first_token": 0, "self": 0, "local": 0, "broad": 0, "punctuation": 1 / 5},
        1: {"first_token": 1, "previous_token": 0, "broad": 0},
        2: {"self": 1, "previous_token": 0},
        3: {"broad": 1, "previous_token": uniform_previous, "self": uniform_previous, "local": uniform_local},
        4: {"induction": 1, "duplicate_token": 0, "first_token": 3 / 11, "local": 8 / 10},
        5: {"duplicate_token": 1, "induction": 0, "first_token": 4 / 11, "local": 0},
        6: {"local": 1, "first_token": 1 / 11},
    }
    for head, values in expected.items():
        got = _scores(report, head)
        for role, value in values.items():
            assert got[role] == pytest.approx(value, abs=1e-4), (head, role)  # reports round to 4 digits
    punctuation_uniform = (1 / 9 + 1 / 10 + 1 / 11 + 1 / 12 + 1 / 13) / 5  # rows 8..12 see the "," at 7
    assert _scores(report, 3)["punctuation"] == pytest.approx(punctuation_uniform, abs=1e-4)
    assert report.unmeasured.keys() == {"next_token", "special_token"}
    roles = {r.role: r for r in report.roles}
    # the positional head reads i-1 on every text: 1 on the text and the two held-out texts, no spread
    lead = roles["previous_token"].top[0]
    assert (lead.layer, lead.head, lead.score, lead.spread, lead.score_on_text) == (0, 0, 1.0, 0.0, 1.0)
    assert roles["previous_token"].inputs == 3 and report.held_out_texts == 2
    # the LM head is tied to the zeroed embeddings: mean-ablating anything changes no loss, so the positional head
    # "attends like" a previous-token head, and the report says removing it changes little
    assert lead.ablation is not None and lead.ablation.value == pytest.approx(0, abs=1e-9)
    assert not lead.ablation.exceeds_baseline and lead.verdict == "attends_only"
    assert "L0H0 attends like a previous-token head" in report.findings[0].detail
    assert "but removing it changes little" in report.findings[0].detail
    assert roles["induction"].top[0].head == 4 and roles["induction"].measured_on == "probe"
    assert roles["duplicate_token"].top[0].head == 5
    assert report.probe is not None and report.probe.length == 11 and report.probe.first_copy_start == 1
    # the LM head is tied to the zeroed embeddings: every token has probability 1/96 on both copies
    check = report.induction_check
    assert check is not None and check.loss_first_copy == pytest.approx(math.log(96), abs=1e-4)
    assert check.loss_second_copy == pytest.approx(math.log(96), abs=1e-4)
    assert "L0H0" in report.summary and "previous_token" in report.summary


def test_crafted_encoder_heads_are_classified_with_exact_scores(crafted, inspector: Inspector) -> None:
    text = "the cat <eos> sat on the mat ."  # 9 tokens; <eos> (special) at 3, "." at 8
    report = get_tool("profile_heads")(inspector, {"model": crafted["encoder"], "text": text, "probe_length": 5})
    primaries = {h.head: h.primary_role for h in report.heads}
    assert primaries == {0: "previous_token", 1: "next_token", 2: "self", 3: "first_token"} | dict.fromkeys(
        range(4, 8), "broad"
    )
    assert _scores(report, 0)["previous_token"] == pytest.approx(1, abs=1e-4)
    assert _scores(report, 1)["next_token"] == pytest.approx(1, abs=1e-4)
    assert _scores(report, 2)["self"] == pytest.approx(1, abs=1e-4)
    assert _scores(report, 3)["first_token"] == pytest.approx(1, abs=1e-4)
    uniform = _scores(report, 5)
    assert uniform["broad"] == pytest.approx(1, abs=1e-4)
    assert uniform["special_token"] == pytest.approx(1 / 9, abs=1e-4)  # every row but 3 sees the <eos> at 3
    assert uniform["punctuation"] == pytest.approx(1 / 9, abs=1e-4)
    assert uniform["next_token"] == pytest.approx(1 / 9, abs=1e-4)
    assert report.induction_check is None  # an encoder has no next-token loss
    assert report.unmeasured == {}


def test_one_forward_per_input_and_deterministic_probe(crafted, inspector: Inspector) -> None:
    loaded = inspector.model(crafted["causal"])
    args = {"model": crafted["causal"], "text": CAUSAL_TEXT, "probe_length": 6, "induction_check": False}
    single = {"seeds": 1, "ablate_top": 0, "held_out_texts": 0}
    # every report states its attention path's gap on the call's last input: two forwards the first time an input
    # is seen, cached after; one call before counting sees the text and the probe once
    get_tool("profile_heads")(inspector, {**args, "seed": 3, **single})
    calls = []
    # the base model runs in every pass (the text pass skips the LM head: no ablation asks for its output)
    handle = loaded.model.base_model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        first = get_tool("profile_heads")(inspector, {**args, "seed": 3, **single})
        assert len(calls) == 2  # one pass over the text, one over the probe, for all 8 heads
        calls.clear()
        get_tool("profile_heads")(inspector, {**args, "seed": 3})
        # the default: the text and two held-out texts, three probes (seeds 3, 4, 5), then the ablation checks of
        # previous_token and induction: one recorded clean run of the probe and one batched forward whose rows
        # mean-ablate each top head and each random head
        assert len(calls) in (3 + 3 + 2, 3 + 3 + 2 + 2)  # + the path check's two forwards on a new last input
        again = get_tool("profile_heads")(inspector, {**args, "seed": 3, **single})
        other = get_tool("profile_heads")(inspector, {**args, "seed": 4, **single})
    finally:
        handle.remove()
    assert first.probe == again.probe and first.heads == again.heads
    assert other.probe is not None and first.probe is not None and other.probe.preview != first.probe.preview


def test_ablation_evidence_and_roles_subset(crafted, inspector: Inspector) -> None:
    report = get_tool("profile_heads")(
        inspector,
        {"model": crafted["causal"], "roles": ["self", "induction"], "probe_length": 5, "ablate_top": 1, "top_k": 1},
    )
    assert report.text_source == "sample" and [r.role for r in report.roles] == ["induction", "self"]
    for role in report.roles:
        evidence = role.top[0].ablation
        assert evidence is not None
        # all logits are 0 whatever the heads do (zeroed, tied embeddings): ablation changes nothing
        assert evidence.value == pytest.approx(0, abs=1e-9)
    assert {r.metric for r in (role.top[0].ablation for role in report.roles) if r} == {
        "second_copy_loss_change",
        "next_token_loss_change",
    }
    # induction has a check that ran and found nothing beyond random heads; self has no check: what was measured
    verdicts = {role.role: role.top[0].verdict for role in report.roles}
    assert verdicts == {"induction": "attends_only", "self": "unchecked"}


def test_bad_arguments_name_the_valid_range(tiny_models, inspector: Inspector) -> None:
    tool = get_tool("profile_heads")
    with pytest.raises(InvalidInputError, match=r"layer 2 out of range 0\.\.1"):
        tool(inspector, {"model": "tiny-llama", "layers": [2]})
    with pytest.raises(InvalidInputError, match="more than once"):
        tool(inspector, {"model": "tiny-llama", "roles": ["self", "self"]})
    with pytest.raises(InvalidInputError, match="roles"):
        tool(inspector, {"model": "tiny-llama", "roles": ["haunted"]})
    with pytest.raises(InvalidInputError, match="thresholds"):
        tool(inspector, {"model": "tiny-llama", "thresholds": {"self": 1.5}})
    with pytest.raises(ResourceLimitError, match=r"use 4\.\.31"):
        tool(inspector, {"model": "tiny-llama", "probe_length": 40})
    fitted = tool(inspector, {"model": "tiny-llama", "roles": ["induction"], "induction_check": False})
    assert fitted.probe is not None and fitted.probe.repeat_length == 31  # the default 32 shrunk to 64 positions
    schema = ProfileHeadsInput.model_json_schema()
    assert "enum" in str(schema["properties"]["roles"])  # the agent sees the role names


@pytest.mark.real_model
def test_default_model_has_induction_heads_that_matter(smol, inspector: Inspector) -> None:
    arguments = {"ablate_top": 1, "roles": ["induction", "previous_token"], "detail": "full"}
    report = get_tool("profile_heads")(inspector, arguments)
    assert len(report.heads) == 270
    induction = next(r for r in report.roles if r.role == "induction")
    assert induction.top[0].score > 0.5 and induction.heads_with_role >= 3
    evidence = induction.top[0].ablation
    assert evidence is not None and evidence.value > 0 and evidence.baseline_draws == 8  # loss rises
    assert evidence.baseline_mean is not None and evidence.exceeds_baseline and induction.top[0].verdict == "is_role"
    previous = next(r for r in report.roles if r.role == "previous_token")
    assert previous.inputs == 3 and previous.top[0].spread is not None and previous.top[0].score > 0.5
    check = report.induction_check
    assert check is not None and check.loss_second_copy < check.loss_first_copy - 5
    assert check.loss_second_copy_ablated is not None and check.loss_second_copy_ablated > check.loss_second_copy + 1
    assert check.baseline_draws == 8 and check.exceeds_baseline


@pytest.mark.real_model
def test_encoder_model_profile(minilm, inspector: Inspector) -> None:
    arguments = {"model": "minilm-l6", "text": "The cat sat on the mat, and slept.", "detail": "full"}
    report = get_tool("profile_heads")(inspector, arguments)
    assert len(report.heads) == 72 and report.induction_check is None
    assert {"next_token", "special_token", "punctuation"} <= {r.role for r in report.roles}
    for head in report.heads:
        assert all(0 <= v <= 1 for v in head.scores.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_profiles_and_ablates(tiny_models, inspector: Inspector, family: str) -> None:
    report = get_tool("profile_heads")(
        inspector, {"model": f"tiny-{family}", "text": CAUSAL_TEXT, "probe_length": 8, "ablate_top": 1, "top_k": 1}
    )
    assert len(report.heads) == 8
    for head in report.heads:
        assert head.scores and all(0 <= v <= 1 for v in head.scores.values())
    assert all(r.top[0].ablation is not None for r in report.roles)
    ablation = get_tool("ablate_heads")(inspector, {"model": f"tiny-{family}", "text": CAUSAL_TEXT, "heads": ["1.3"]})
    assert (ablation.kl_mean if ablation.measure == "next_token" else ablation.pooled_cosine_change) is not None


def _dense_reference(weights, layout, roles, allowed):
    """The role formulas with dense (q, k) kernels: mean over rows i >= skip that may read a kernel key of
    sum_j A[i, j] * P[i, j]."""
    from agent_tools.analysis.heads import ROLES

    rows = torch.arange(weights.shape[-2])
    visible = allowed[:, 0].expand(weights.shape[0], -1, -1)  # (B, q, k)
    out = {}
    for role in roles:
        kernel = ROLES[role].kernel(layout).dense(rows, weights.shape[-1])  # (q, k)
        row_mask = (rows >= layout.skip_queries)[None] & ((kernel.bool()[None] & visible).any(-1))  # (B, q)
        shares = (weights * kernel).sum(-1)  # (B, H, q)
        out[role] = (shares * row_mask[:, None]).sum(dim=(0, 2)) / row_mask.sum()
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_fast_role_sums_equal_the_dense_kernel_formulas(causal: bool) -> None:
    from agent_tools.analysis.heads import SequenceLayout
    from agent_tools.consumers.roles import RoleAccumulator

    torch.manual_seed(3)
    length, heads = 13, 3
    tokens = [f"w{i}" if i % 4 else "." for i in range(length)]
    special = [i in (0, 6) for i in range(length)]
    layout = SequenceLayout.for_text(tokens, special, causal=causal)
    probe = SequenceLayout.for_probe(length, start=1, repeat_length=5, causal=causal)
    allowed = torch.ones(length, length, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    allowed = allowed[None, None]
    logits = torch.randn(2, heads, length, length).masked_fill(~allowed, float("-inf"))
    weights = logits.softmax(-1)
    for lay in (layout, probe):
        roles = [r for r in lay_roles(lay) if r != "broad"]
        expected = _dense_reference(weights, lay, roles, allowed)
        accumulator = RoleAccumulator(lay, roles, heads)
        for start in range(0, length, 5):  # query chunks
            stop = min(start + 5, length)
            accumulator.add(weights[:, :, start:stop], torch.arange(start, stop), allowed[:, :, start:stop])
        got = accumulator.scores()
        for role in roles:
            assert torch.allclose(got[role], expected[role].float(), atol=1e-6), role


def lay_roles(layout):
    from agent_tools.analysis.heads import HEAD_ROLES

    return [r for r in HEAD_ROLES if layout.measurable(r)]


# --- the known circuit: previous-token → induction (K-composition), and a sink that writes nothing ----------------
CIRCUIT_TEXT = "the cat sat on the mat red blue green one two three"  # 12 words + <bos>: 13 tokens


@pytest.fixture(scope="module")
def circuit() -> str:
    return register_model("circuit-profile", induction_circuit(), circuit_tokenizer()).name


def test_profile_names_exactly_the_circuits_heads_with_evidence_and_baselines(circuit, inspector: Inspector) -> None:
    report = get_tool("profile_heads")(inspector, {"model": circuit, "text": CIRCUIT_TEXT})
    primaries = {(h.layer, h.head): h.primary_role for h in report.heads}
    assert {k: v for k, v in primaries.items() if v != "broad"} == {
        PREVIOUS_HEAD: "previous_token",
        INDUCTION_HEAD: "induction",
        SINK_HEAD: "first_token",
    }
    roles = {r.role: r for r in report.roles}
    assert (roles["previous_token"].top[0].layer, roles["previous_token"].top[0].head) == PREVIOUS_HEAD
    assert (roles["induction"].top[0].layer, roles["induction"].top[0].head) == INDUCTION_HEAD
    assert (roles["first_token"].top[0].layer, roles["first_token"].top[0].head) == SINK_HEAD
    for role in ("previous_token", "induction", "first_token"):
        assert roles[role].top[0].score == pytest.approx(1.0, abs=1e-4)
    # uniform baselines by hand: rows 2..12 of the text put 1/(i+1) on any one key; the probe's second copy
    # (rows 29..56 of [bos] + 2×28) likewise on the token after the earlier copy
    text_uniform = sum(1 / (i + 1) for i in range(2, 13)) / 11
    assert roles["previous_token"].uniform_baseline == pytest.approx(text_uniform, abs=1e-4)
    assert roles["first_token"].uniform_baseline == pytest.approx(text_uniform, abs=1e-4)
    assert roles["induction"].uniform_baseline == pytest.approx(sum(1 / (i + 1) for i in range(29, 57)) / 28, abs=1e-4)
    # three probes, the same circuit on each: no spread; the checks by default on previous_token and induction
    assert report.probe is not None and report.probe.seeds == [0, 1, 2]
    assert roles["induction"].top[0].spread == pytest.approx(0.0, abs=1e-6)
    for role in ("induction", "previous_token"):
        evidence = [t.ablation for t in roles[role].top]
        # removing either head of the circuit breaks the copy: the second-copy loss rises by nats
        assert evidence[0] is not None and evidence[0].metric == "second_copy_loss_change" and evidence[0].value > 3
        assert all(e is not None and e.value == pytest.approx(0.0, abs=1e-4) for e in evidence[1:])  # write nothing
        # the random heads are the ones not under test: uniform heads writing a constant aside and the no-op sink,
        # whose mean-ablation changes nothing: 0 ± 0 over every one of the four
        assert evidence[0].baseline_draws == 4 and evidence[0].baseline_mean == pytest.approx(0.0, abs=1e-6)
        assert evidence[0].baseline_spread == pytest.approx(0.0, abs=1e-6) and evidence[0].exceeds_baseline
        assert roles[role].top[0].verdict == "is_role" and roles[role].top[1].verdict == "below_threshold"
    assert roles["first_token"].top[0].verdict == "unchecked" and roles["first_token"].top[0].ablation is None
    details = {f.kind: f.detail for f in report.findings}
    assert details["previous_token"].startswith("L0H0 is a previous-token head (score 1.00 ± 0.00 over 3 texts;")
    assert "4 random heads: +0.00 ± 0.00" in details["previous_token"]
    assert details["induction"].startswith("L1H0 is an induction head (score 1.00 ± 0.00 over 3 probes;")
    assert details["first_token"].startswith("L1H1 attends like a first-token head")
    check = report.induction_check
    assert check is not None and check.exceeds_baseline and check.baseline_draws == 8
    assert check.baseline_mean == pytest.approx(check.loss_second_copy, abs=1e-4)  # random sets change nothing
    assert "vs uniform" in report.summary and "3 probes (seeds 0–2)" in report.summary
    assert report.next_calls and report.next_calls[0].tool == "ablate_heads"


def test_probe_scores_are_the_mean_over_seeds_with_their_spread(crafted, inspector: Inspector) -> None:
    args = {"model": crafted["causal"], "roles": ["induction", "duplicate_token"], "probe_length": 6, "top_k": 8}
    single = [
        get_tool("profile_heads")(inspector, {**args, "seed": seed, "seeds": 1, "ablate_top": 0}) for seed in (5, 6)
    ]
    both = get_tool("profile_heads")(inspector, {**args, "seed": 5, "seeds": 2, "ablate_top": 0})
    for index, head in enumerate(both.heads):
        for role in ("induction", "duplicate_token"):
            values = [report.heads[index].scores[role] for report in single]
            assert head.scores[role] == pytest.approx(sum(values) / 2, abs=2e-4)
            assert head.score_spread[role] == pytest.approx(abs(values[0] - values[1]) / 2, abs=2e-4)


def test_diagnose_collapse_names_the_positional_head_and_the_no_op_sink(circuit, inspector: Inspector) -> None:
    report = get_tool("diagnose_collapse")(inspector, {"model": circuit, "text": CIRCUIT_TEXT, "top_k": 8})
    verdicts = {(h.layer, h.head): h.verdict for h in report.heads}
    assert {k: v for k, v in verdicts.items() if v != "not_collapsed"} == {
        PREVIOUS_HEAD: "positional",
        SINK_HEAD: "no_op_sink",
    }


# --- the registry and user patterns ---------------------------------------------------------------------------------


def test_the_registry_is_the_one_definition_of_every_role() -> None:
    from agent_tools.analysis.heads import (
        DEFAULT_THRESHOLDS,
        FALLBACK_ROLES,
        PROBE_ROLES,
        ROLES,
        TEXT_ROLES,
    )

    assert tuple(ROLES) == HEAD_ROLES and all(ROLES[r].name == r for r in HEAD_ROLES)
    assert PROBE_ROLES == ("induction", "duplicate_token") and FALLBACK_ROLES == ("first_token", "broad")
    assert set(TEXT_ROLES) | set(PROBE_ROLES) == set(HEAD_ROLES)
    assert DEFAULT_THRESHOLDS == {  # the registry's thresholds, pinned as documented
        "previous_token": 0.4,
        "induction": 0.3,
        "duplicate_token": 0.3,
        "first_token": 0.5,
        "self": 0.3,
        "local": 0.5,
        "broad": 0.8,
        "next_token": 0.4,
        "special_token": 0.3,
        "punctuation": 0.3,
    }
    assert all(ROLES[r].formula for r in HEAD_ROLES)
    assert {r for r in HEAD_ROLES if ROLES[r].ablation_check} == {"previous_token", "induction"}


@pytest.mark.parametrize("causal", [True, False])
def test_a_user_pattern_equal_to_a_roles_kernel_scores_like_the_role(causal: bool) -> None:
    from agent_tools.analysis.heads import ROLES
    from agent_tools.consumers.roles import pattern_scores

    torch.manual_seed(5)
    length, heads = 13, 3
    tokens = [f"w{i}" if i % 4 else "." for i in range(length)]
    layout = SequenceLayout.for_text(tokens, [i in (0, 6) for i in range(length)], causal=causal)
    probe = SequenceLayout.for_probe(length, start=1, repeat_length=5, causal=causal)
    allowed = torch.ones(length, length, dtype=torch.bool)
    allowed = allowed.tril() if causal else allowed
    weights = torch.randn(heads, length, length).masked_fill(~allowed, float("-inf")).softmax(-1)
    rows = torch.arange(length)
    checked = 0
    for lay in (layout, probe):
        for role in (r for r in HEAD_ROLES if r != "broad" and lay.measurable(r)):
            built_in = role_scores(weights, lay, [role])[role]
            mask = ROLES[role].kernel(lay).dense(rows, length)  # (T, T): the role's kernel as a user's tensor
            user = pattern_scores(weights, mask, causal=causal, skip_queries=lay.skip_queries)
            assert torch.allclose(user, built_in, atol=1e-6), role
            checked += 1
    assert checked == (12 if causal else 14)  # 6 (7 with next_token) on the text and on the probe


def test_pattern_scores_by_hand() -> None:
    from agent_tools.analysis.heads import after_same_token_mask, same_token_mask
    from agent_tools.consumers.roles import pattern_scores

    ids = torch.tensor([0, 5, 6, 5, 6])  # <bos> a b a b
    assert same_token_mask(ids).nonzero().tolist() == [[1, 3], [2, 4], [3, 1], [4, 2]]
    # key j follows another copy of the query's token: query 3 (a) reads 2 (after the a at 1), 4 (b) reads 3
    # (after the b at 2), query 1 reads 4 (after the a at 3; a causal row cannot see it); query 2's other b is last
    assert after_same_token_mask(ids).nonzero().tolist() == [[1, 4], [3, 2], [4, 3]]
    uniform = uniform_causal(5)[None]  # (1, 5, 5)
    # causal rows that may read a key of the pattern: 3 (key 2) and 4 (key 3); each gives 1/(i+1)
    got = pattern_scores(uniform, lambda t: after_same_token_mask(t), input_ids=ids)
    assert got.tolist() == pytest.approx([(1 / 4 + 1 / 5) / 2], abs=EXACT)
    # weights, not just masks: half a weight on key 0 from every row i >= 2 -> mean of A[i, 0] / 2
    half = torch.zeros(5, 5)
    half[:, 0] = 0.5
    got = pattern_scores(uniform, half, skip_queries=2)
    assert got.tolist() == pytest.approx([(1 / 3 + 1 / 4 + 1 / 5) / 3 / 2], abs=EXACT)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        pattern_scores(uniform, half * 3)


def test_named_patterns_through_the_tool_and_python(crafted, inspector: Inspector) -> None:
    from agent_tools.analysis.heads import same_token_mask
    from agent_tools.tools.profile_heads import detect_pattern

    args = {"model": crafted["causal"], "text": CAUSAL_TEXT, "roles": ["previous_token", "self"], "top_k": 8}
    report = get_tool("profile_heads")(
        inspector, {**args, "patterns": ["previous_token", "same_token", "self"], "ablate_top": 0}
    )
    patterns = {p.name: p for p in report.patterns}
    roles = {r.role: r for r in report.roles}
    for name in ("previous_token", "self"):  # the same kernel, the same texts: the same numbers as the role
        assert [(t.layer, t.head, t.score, t.spread) for t in patterns[name].top] == [
            (t.layer, t.head, t.score, t.spread) for t in roles[name].top
        ]
        assert patterns[name].uniform_baseline == roles[name].uniform_baseline
    # "the" at 1 and 5, "." at 12 only once: same_token rows are 5 (reads 1) ... measured on the text alone
    same = {(t.layer, t.head): t.score_on_text for t in patterns["same_token"].top}
    python = detect_pattern(inspector, crafted["causal"], CAUSAL_TEXT, same_token_mask)
    assert all(same[(0, head)] == pytest.approx(float(python[0][head]), abs=1e-4) for head in range(8))
    # a (T, T) tensor: the previous-token kernel by hand gives the role's score on the text
    previous = torch.diag(torch.ones(12), -1)  # (13, 13): key i-1
    python = detect_pattern(inspector, crafted["causal"], CAUSAL_TEXT, previous)
    on_text = {h.head: h.scores["previous_token"] for h in report.heads}
    assert all(on_text[head] == pytest.approx(float(python[0][head]), abs=1e-4) for head in range(8))
    with pytest.raises(InvalidInputError, match="same_token"):  # the error names the valid patterns
        get_tool("profile_heads")(inspector, {**args, "patterns": ["haunted"]})


def test_previous_token_check_alone_builds_its_probe(circuit, inspector: Inspector) -> None:
    report = get_tool("profile_heads")(
        inspector, {"model": circuit, "text": CIRCUIT_TEXT, "roles": ["previous_token"], "held_out_texts": 1}
    )
    (role,) = report.roles
    assert role.inputs == 2 and report.held_out_texts == 1  # the text and one held-out text
    assert report.probe is not None and report.probe.seeds == [0]  # built for the check, scored nothing
    lead = role.top[0]
    assert lead.ablation is not None and lead.ablation.value > 3 and lead.ablation.baseline_draws == 5
    # Only the previous-token heads are kept out of the draws, so one of the 5 random heads is the induction head
    # (its removal costs as much as the previous-token head's, x = 5.388 nats), the other four cost 0: mean x / 5,
    # Σ dev² = x²·(4/5)² + 4·(x/5)² = 4x²/5, SAMPLE sd sqrt(4x²/5 / 4) = x / √5 = 2.4097. The bar x/5 + 2x/√5 = 1.094x
    # = 5.897 is above the head's 5.4226: not beyond chance. (The population sd 2x/5 put the bar at x exactly, and
    # the head passed it by 0.03 nats: the lenient verdict the sample sd removes.)
    x = 5 * lead.ablation.baseline_mean
    assert lead.ablation.baseline_spread == pytest.approx(x / math.sqrt(5), rel=1e-5)
    assert x < lead.ablation.value < x / 5 + 2 * x / math.sqrt(5)
    assert (lead.layer, lead.head) == PREVIOUS_HEAD and not lead.ablation.exceeds_baseline
    assert lead.verdict == "attends_only"


def test_the_analyze_story_says_confirmed_only_with_the_check(circuit, inspector: Inspector) -> None:
    from agent_tools.report.story import roles_step

    report = get_tool("profile_heads")(inspector, {"model": circuit, "text": CIRCUIT_TEXT})

    class Result:  # the one thing roles_step reads without a probe view
        probe = None

        def report(self, tool, kind):
            return report

    step = roles_step(Result())
    assert step is not None
    said = " ".join(step.sentences)
    assert "previous-token L0H0 (1.00 ± 0.00; confirmed: mean-ablation +5.42 nats vs 4 random heads +0.00" in said
    assert "first-token L1H1 (1.00 ± 0.00)" in said  # no check for this role: no "confirmed"
    assert "with L1H0, L0H1, L0H2 mean-ablated (0.00 ± 0.00 with 8 random sets of as many heads)" in said
