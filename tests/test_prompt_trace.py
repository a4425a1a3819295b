"""trace_prompt_attention and compare_prompts: the greedy KV-cache loop against a full forward, shares against a
hand reduction of the captured rows, generate vs last consistency, bad inputs, and the real model end to end."""

from __future__ import annotations

import copy

import pytest
import torch
from families import tiny_tokenizer

from agent_tools.analysis.rollout import attention_rollout
from agent_tools.capture import capture_attention
from agent_tools.consumers.last_row import LastRowConsumer
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Inspector, check_new_tokens
from agent_tools.loading import LoadedModel, register_model
from agent_tools.tools import get_tool
from agent_tools.tools.compare_prompts import PromptComparison
from agent_tools.tools.trace_prompt_attention import PromptTrace
from agent_tools.traced_prompt.models import MeasuredTrace

TINY_TEXT = "the cat sat on the mat because it was tired and the dog sat on the mat"
CHAT_TEMPLATE = (
    "{% for m in messages %}<bos> {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<bos> assistant {% endif %}"
)
CHAT = [
    {"role": "system", "content": "the cat sat on the mat"},
    {"role": "user", "content": "the dog was tired"},
    {"role": "assistant", "content": "it sat"},
    {"role": "user", "content": "and the cat ?"},
]


@pytest.fixture(scope="module")
def tiny_chat(tiny_models) -> LoadedModel:
    """The tiny Llama with a word-level tokenizer that has a chat template (<bos>/<eos> as the markers)."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return register_model("tiny-chat-llama", copy.deepcopy(tiny_models["llama"].model), tokenizer)


class AllRows:
    """Keeps every layer's full (H, T, T) map of a forward without cache (the reference)."""

    accepts_key_prefix = False

    def __init__(self) -> None:
        self.maps: dict[int, torch.Tensor] = {}

    def on_layer(self, layer) -> None:
        self.maps[layer.layer] = layer.weights[0].float().clone()

    def stacked(self) -> torch.Tensor:
        return torch.stack([self.maps[i] for i in sorted(self.maps)])  # (L, H, T, T)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt2"])
def test_kv_cache_steps_equal_the_full_forward(family: str, tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models[family]
    encoded = inspector.encode(loaded, "the cat sat on the mat because it")
    rows = LastRowConsumer()
    steps: list[torch.Tensor] = []
    generation = inspector.generate(
        loaded,
        encoded,
        max_new_tokens=6,
        step_consumers=[rows],
        on_step=lambda step, token: steps.append(rows.take(encoded.length + step)),
    )
    tokens = generation.token_ids
    assert 1 <= len(tokens) <= 6 and len(steps) == len(tokens)
    assert generation.stopped == ("eos" if tokens[-1] == 1 else "max_new_tokens")
    # reference: no cache, the whole sequence at once; greedy choices and every step's rows must agree
    ids = torch.cat([encoded.input_ids, torch.tensor([tokens[:-1]], dtype=torch.long)], dim=1)
    reference = AllRows()
    with torch.inference_mode(), capture_attention(loaded.model, [reference]):
        logits = loaded.model(input_ids=ids).logits[0]
    length = encoded.length
    assert logits[length - 1 :].argmax(-1).tolist() == tokens
    maps = reference.stacked()
    for step, step_rows in enumerate(steps):
        position = length - 1 + step
        assert step_rows.shape == (maps.shape[0], maps.shape[1], position + 1)
        assert torch.allclose(step_rows, maps[:, :, position, : position + 1], atol=1e-5)


def test_generation_stops_at_eos(tiny_models, inspector: Inspector) -> None:
    source = tiny_models["llama"]
    encoded = inspector.encode(source, "the cat sat on the mat")
    first = inspector.generate(source, encoded, max_new_tokens=1).token_ids[0]
    model = copy.deepcopy(source.model)
    model.generation_config.eos_token_id = first  # its first greedy token now ends the answer
    loaded = register_model("tiny-llama-eos", model, source.tokenizer)
    generation = inspector.generate(loaded, encoded, max_new_tokens=5)
    assert generation.token_ids == [first] and generation.stopped == "eos" and generation.step_seconds == []


def test_trace_last_equals_a_hand_reduction_of_the_captured_rows(tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models["llama"]
    report = get_tool("trace_prompt_attention")(
        inspector,
        {
            "model": "tiny-llama",
            "prompt": TINY_TEXT,
            "segments": [{"name": "dog", "text": "the dog sat"}],
            "top_k": 2,
            "detail": "full",
        },
    )
    assert isinstance(report, PromptTrace)
    encoded = inspector.encode(loaded, TINY_TEXT)
    reference = AllRows()
    with torch.inference_mode(), capture_attention(loaded.model, [reference]):
        loaded.model(input_ids=encoded.input_ids)
    maps = reference.stacked()  # (L, H, T, T)
    last = maps[:, :, -1]  # (L, H, T)
    rollout = attention_rollout([m.mean(0) for m in maps])[-1]  # (T,)
    by_name = {s.name: s for s in report.segments}
    assert report.sink_positions[0] == 0 and by_name["sink"].positions == report.sink_positions
    # the tokenizer's <bos> (no characters: 'special') is the sink, and the emptied 'special' segment is dropped
    assert set(by_name) == {"sink", "text", "dog"} and encoded.tokens[0].special
    for segment in report.segments:
        index = torch.tensor(segment.positions, dtype=torch.long)
        assert segment.share == pytest.approx(float(last[:, :, index].sum(-1).mean()), abs=1e-4)
        assert segment.last_layer_share == pytest.approx(float(last[-1, :, index].sum(-1).mean()), abs=1e-4)
        assert segment.rollout_share == pytest.approx(float(rollout[index].sum()), abs=1e-4)
        for top in segment.top_tokens:
            assert top.weight == pytest.approx(float(last[:, :, top.position].mean()), abs=1e-4)
    assert sum(s.share for s in report.segments) == pytest.approx(1.0, abs=1e-3)
    free = [s.share_without_sink for s in report.segments if s.name != "sink"]
    assert sum(free) == pytest.approx(1.0, abs=1e-3)
    assert "".join(encoded.tokens[p].text + " " for p in by_name["dog"].positions).strip() == "the dog sat"
    assert report.read_most in {"text", "dog"} and report.next_tokens and len(report.next_tokens) == 5
    # 'dog' is the only named segment ('text' is the unnamed rest): the summary prints the share it is read by
    assert report.read_most == "dog" and by_name["text"].tier == "gap" and by_name["dog"].tier == "named"
    assert f"'dog', the only named segment, with {by_name['dog'].content_share:.1%}" in report.summary


def test_trace_generate_on_chat_is_consistent_with_last(tiny_chat, inspector: Inspector) -> None:
    arguments = {"model": "tiny-chat-llama", "prompt": CHAT, "segments": [{"name": "dog", "text": "dog", "message": 1}]}
    last = get_tool("trace_prompt_attention")(inspector, arguments)
    generated = get_tool("trace_prompt_attention")(inspector, {**arguments, "target": "generate", "max_new_tokens": 5})
    names = [s.name for s in last.segments]
    assert names[0] == "sink" and {"system#1", "user#1", "dog", "assistant#1", "user#2", "template"} <= set(names)
    assert last.rendered_prompt.startswith("<bos> system the cat sat on the mat <eos>")
    assert generated.generated is not None and 1 <= len(generated.generated) <= 5
    assert generated.stopped in {"eos", "max_new_tokens"} and generated.generated_text is not None
    first = generated.generated[0]
    # step 0 is the last prompt position: the same row as target 'last'
    for segment in last.segments:
        assert first.shares[segment.name] == pytest.approx(segment.share, abs=2e-4)
    assert first.shares["generated"] == 0.0 and first.position == last.answer_position
    prompt_length = last.num_tokens
    by_name = {s.name: s for s in generated.segments}
    assert by_name["generated"].positions == list(range(prompt_length, prompt_length + len(generated.generated) - 1))
    for step in generated.generated:
        assert sum(step.shares.values()) == pytest.approx(1.0, abs=1e-3)
        eligible = {n: v for n, v in step.shares.items() if n not in {"sink", "template", "generated"}}
        assert step.read_most == max(eligible, key=eligible.get)
        assert step.position == last.answer_position + step.step
    mean = sum(step.shares["user#2"] for step in generated.generated) / len(generated.generated)
    assert by_name["user#2"].share == pytest.approx(mean, abs=2e-4)
    assert by_name["generated"].rollout_share is None
    assert generated.seconds_per_token is None or generated.seconds_per_token > 0


def test_compare_prompts_on_tiny_chat(tiny_chat, inspector: Inspector) -> None:
    tool = get_tool("compare_prompts")
    same = tool(inspector, {"model": "tiny-chat-llama", "prompt_a": CHAT, "prompt_b": CHAT, "detail": "full"})
    assert isinstance(same, PromptComparison)
    trace = get_tool("trace_prompt_attention")(
        inspector, {"model": "tiny-chat-llama", "prompt": CHAT, "detail": "full"}
    )
    numbers = trace.model_dump(include=set(MeasuredTrace.model_fields))  # the trace's report less its words
    assert same.trace_a.model_dump() == same.trace_b.model_dump() == numbers
    assert same.read_most_a == trace.read_most and same.next_tokens_a == trace.next_tokens
    assert same.next_token_kl == pytest.approx(0.0, abs=1e-9) and same.same_top_token
    assert all(row.change == 0 for row in same.segments)
    reworded = [*CHAT[:3], {"role": "user", "content": "and the dog ?"}]
    without_system = CHAT[1:]
    shifted = tool(
        inspector,
        {
            "model": "tiny-chat-llama",
            "prompt_a": reworded,
            "prompt_b": without_system,
            "target": "generate",
            "max_new_tokens": 3,
        },
    )
    rows = {row.name: row for row in shifted.segments}
    assert rows["system#1"].share_b is None and rows["system#1"].token_count_b == 0
    assert rows["system#1"].change == pytest.approx(-rows["system#1"].share_a, abs=1e-6)
    for row in shifted.segments:
        assert row.change == pytest.approx((row.share_b or 0) - (row.share_a or 0), abs=2e-4)
    changes = [abs(r.change) for r in shifted.segments]
    assert changes == sorted(changes, reverse=True)
    assert shifted.next_token_kl is not None and shifted.next_token_kl >= 0
    assert shifted.generated_text_a is not None and shifted.generated_text_b is not None
    assert shifted.segments[0].name in shifted.summary


BAD = [
    ({"prompt": []}, InvalidInputError, "empty message list"),
    ({"prompt": [{"role": "tool", "content": "the cat"}]}, InvalidInputError, "allowed roles: system, user, assistant"),
    ({"prompt": [{"role": "user", "content": "  "}]}, InvalidInputError, "empty or whitespace"),
    ({"prompt": [{"role": "user", "content": "the cat", "name": "x"}]}, InvalidInputError, "unknown argument"),
    ({"prompt": CHAT, "segments": [{"name": "x", "text": "zebra"}]}, InvalidInputError, "'zebra' not found"),
    (
        {"prompt": CHAT, "segments": [{"name": "x", "start": 0, "end": 40, "message": 0}]},
        InvalidInputError,
        "out of range",
    ),
    (
        {"prompt": CHAT, "target": "generate", "max_new_tokens": 0},
        InvalidInputError,
        r"max_new_tokens 0 out of range 1\.\.256",
    ),
    ({"prompt": CHAT, "target": "generate", "max_new_tokens": 257}, InvalidInputError, r"out of range 1\.\.256"),
    (
        {"prompt": CHAT, "target": "generate", "max_new_tokens": 60},
        ResourceLimitError,
        r"30 tokens \+ max_new_tokens 60 exceeds 64 tokens.*max_new_tokens <= 34",
    ),
    ({"prompt": CHAT, "target": "next"}, InvalidInputError, "'last' or 'generate'"),
    ({"prompt": CHAT, "sink_threshold": 0}, InvalidInputError, "sink_threshold"),
    (
        {"prompt": CHAT, "target": "generate", "answer_stop": "paragraph"},
        InvalidInputError,
        "'line', 'eos', 'sentence'",
    ),
    ({"prompt": CHAT, "target": "generate", "answer_stop": "tokens x"}, InvalidInputError, "'tokens N' with a whole"),
    (
        {"prompt": CHAT, "target": "generate", "answer_stop": "tokens 3", "max_new_tokens": 4},
        InvalidInputError,
        "disagree; give the count once",
    ),
]


@pytest.mark.parametrize(("arguments", "error", "message"), BAD)
def test_bad_input_is_a_clear_error(tiny_chat, inspector: Inspector, arguments, error, message) -> None:
    with pytest.raises(error, match=message):
        get_tool("trace_prompt_attention")(inspector, {"model": "tiny-chat-llama", **arguments})


def test_bad_input_other_models(tiny_models, inspector: Inspector) -> None:
    tool = get_tool("trace_prompt_attention")
    with pytest.raises(InvalidInputError, match="no chat template; send plain text"):
        tool(inspector, {"model": "tiny-llama", "prompt": [{"role": "user", "content": "the cat"}]})
    with pytest.raises(InvalidInputError, match=r"no next-token head.*target='last'"):
        tool(inspector, {"model": "tiny-bert", "prompt": "the cat sat", "target": "generate"})
    encoder = tool(inspector, {"model": "tiny-bert", "prompt": "the cat sat on the mat"})
    assert encoder.next_tokens is None and sum(s.share for s in encoder.segments) == pytest.approx(1, abs=1e-3)
    with pytest.raises(InvalidInputError, match=r"max_new_tokens 0 out of range 1\.\.256"):
        check_new_tokens(0)
    with pytest.raises(InvalidInputError, match="message=0 given but the prompt is plain text"):
        tool(
            inspector,
            {"model": "tiny-llama", "prompt": "the cat", "segments": [{"name": "c", "text": "cat", "message": 0}]},
        )


# --- the real model, end to end (few and short) -----------------------------------------------------------------
CODE_PROMPT = [
    {"role": "system", "content": "You are a helpful assistant. The secret code is 4721."},
    {"role": "user", "content": "What is the secret code? Answer with the number only."},
]


@pytest.mark.real_model
def test_default_model_generates_and_traces(smol, inspector: Inspector) -> None:
    report = get_tool("trace_prompt_attention")(
        inspector,
        {
            "prompt": CODE_PROMPT,
            "segments": [{"name": "code", "text": "4721"}],
            "target": "generate",
            "max_new_tokens": 4,
            "answer_stop": "tokens",
        },
    )
    assert report.rendered_prompt.startswith("<|im_start|>system\nYou are a helpful assistant.")
    names = [s.name for s in report.segments]
    assert names == ["sink", "system#1", "code", "user#1", "template", "generated"]
    assert report.sink_positions[0] == 0 and report.segments[0].positions[0] == 0
    assert report.generated is not None and len(report.generated) == 4 and report.stopped == "max_new_tokens"
    for step in report.generated:
        assert sum(step.shares.values()) == pytest.approx(1.0, abs=1e-3)
    assert sum(s.share for s in report.segments) == pytest.approx(1.0, abs=1e-3)
    assert report.seconds_per_token and report.seconds_per_token > 0
    assert report.read_most in report.summary and "points over" in report.summary
    assert report.answer_stop == "tokens" and report.answer_evidence.tokens == [g.token for g in report.generated]


@pytest.mark.real_model
def test_default_model_compare(smol, inspector: Inspector) -> None:
    tool = get_tool("compare_prompts")
    fact = [{"name": "fact", "text": "The secret code is 4721."}]
    report = tool(inspector, {**tool.example, "segments_a": fact, "segments_b": fact})
    assert report.next_token_kl is not None and report.next_token_kl > 0
    rows = {row.name: row for row in report.segments}
    assert set(rows) == {"sink", "text", "fact"}
    for trace in (report.trace_a, report.trace_b):  # every token in exactly one segment, the sink included
        positions = sorted(p for segment in trace.segments for p in segment.positions)
        assert positions == list(range(trace.num_tokens)) and trace.sink_positions[0] == 0
    assert report.trace_a.prompt_format == report.trace_b.prompt_format == "text"


# --- evidence beside attention ------------------------------------------------------------------------------------
class ValueRows:
    """Every layer's last query row and its values (the reference for value-weighted shares)."""

    accepts_key_prefix = False

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def on_layer(self, layer) -> None:
        self.rows[layer.layer] = layer.weights[0, :, -1].float().clone()  # (H, T)
        self.values[layer.layer] = layer.head_key(layer.value)[0].float().clone()  # (H, T, D)


def test_value_shares_equal_a_hand_reduction_and_uniform_shares_count_tokens(tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models["llama"]
    segments = [{"name": "dog", "text": "the dog sat"}]
    report = get_tool("trace_prompt_attention")(
        inspector, {"model": "tiny-llama", "prompt": TINY_TEXT, "segments": segments, "detail": "full"}
    )
    encoded = inspector.encode(loaded, TINY_TEXT)
    reference = ValueRows()
    with torch.inference_mode(), capture_attention(loaded.model, [reference]):
        loaded.model(input_ids=encoded.input_ids)
    facts = loaded.facts
    shares = []
    for layer in range(facts.num_layers):
        o_weight = loaded.model.model.layers[layer].self_attn.o_proj.weight.float()  # (C, H·D)
        per_head = o_weight.reshape(o_weight.shape[0], facts.num_heads, facts.head_dim)  # (C, H, D)
        written = torch.einsum("htd,chd->htc", reference.values[layer], per_head).norm(dim=-1)  # (H, T) ‖v W_O^h‖
        weighted = reference.rows[layer] * written
        shares.append(weighted / weighted.sum(-1, keepdim=True))
    tokens = torch.stack(shares).mean((0, 1))  # (T,)
    for segment in report.segments:
        assert segment.value_share == pytest.approx(float(tokens[list(segment.positions)].sum()), abs=1e-4)
        assert segment.uniform_share == pytest.approx(segment.token_count / encoded.length, abs=1e-4)
        assert all(t.value_share == pytest.approx(float(tokens[t.position]), abs=1e-4) for t in segment.token_shares)
    assert report.checks == ["causal", "value"] and {s.name for s in report.segments if s.causal} == {"dog", "text"}
    assert {v.view for v in report.views} >= {"share", "last_layer", "rollout", "value", "causal"}


def test_chat_trace_next_calls_drop_the_segment_it_depends_on(tiny_chat, inspector: Inspector) -> None:
    arguments = {"model": "tiny-chat-llama", "prompt": CHAT}
    report = get_tool("trace_prompt_attention")(inspector, arguments)
    lead = report.depends_on_most
    assert lead is not None and lead in {"system#1", "user#1", "assistant#1", "user#2"}
    compare = next(c for c in report.next_calls if c.tool == "compare_prompts")
    role, turn = lead.split("#")
    index = [i for i, m in enumerate(CHAT) if m["role"] == role][int(turn) - 1]
    assert compare.arguments["prompt_b"] == [m for i, m in enumerate(CHAT) if i != index]
    assert {c.tool for c in report.next_calls} == {"compare_prompts", "trace_prompt_attention", "ablate_heads"}
    follow = get_tool("compare_prompts")(inspector, compare.arguments)  # the suggested call is valid as written
    assert follow.next_token_kl is not None


# --- answer_stop: where a generated answer ends, and which tokens are measured --------------------------------------
class WordTokenizer:
    """decode() over a fixed list of token texts (ids index it): enough for the stop rules."""

    def __init__(self, words: list[str]) -> None:
        self.words = words

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.words[i] for i in ids if not (skip_special_tokens and self.words[i] == "<eos>"))


def test_stop_rules_and_measured_tokens_by_hand() -> None:
    from types import SimpleNamespace

    from agent_tools.traced_prompt.answer import measured_ids, stop_rule

    words = ["\n", " Paris", ".", " It", "<eos>", " is", "\n\n", "3", ".14"]
    loaded = SimpleNamespace(tokenizer=WordTokenizer(words))
    line, sentence = stop_rule(loaded, "line"), stop_rule(loaded, "sentence")
    assert stop_rule(loaded, "eos") is None and stop_rule(loaded, "tokens") is None
    assert line([0]) is None and line([0, 1]) is None  # a leading line break does not end the answer
    assert line([0, 1, 6]) == "line" and measured_ids(loaded, [0, 1, 6], "line") == [0, 1]  # the break left out
    assert sentence([1, 2]) is None and sentence([1, 2, 3]) == "sentence"  # ". It": the sentence ended
    assert measured_ids(loaded, [1, 2, 3], "sentence") == [1, 2]
    assert sentence([7, 8]) is None and sentence([7, 8, 5]) is None  # "3.14 is": no sentence end
    assert measured_ids(loaded, [1, 2, 4], "eos") == [1, 2] and measured_ids(loaded, [4], "eos") == [4]
    assert measured_ids(loaded, [1, 3, 5], "max_new_tokens") == [1, 3, 5]


def test_generation_stops_where_the_rule_says(tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models["llama"]
    encoded = inspector.encode(loaded, "the cat sat on the mat")
    free = inspector.generate(loaded, encoded, max_new_tokens=5)
    ruled = inspector.generate(
        loaded, encoded, max_new_tokens=5, stop_when=lambda ids: "line" if len(ids) == 2 else None
    )
    if free.stopped == "max_new_tokens":  # no EOS in the first two tokens: the rule stops after the second
        assert ruled.token_ids == free.token_ids[:2] and ruled.stopped == "line"


def test_answer_stop_tokens_n_form_and_the_report_lists_the_measured_tokens(tiny_chat, inspector: Inspector) -> None:
    tool = get_tool("trace_prompt_attention")
    assert tool.parse({"prompt": "hi", "answer_stop": "tokens 3"}).max_new_tokens == 3
    report = tool(
        inspector, {"model": "tiny-chat-llama", "prompt": CHAT, "target": "generate", "answer_stop": "tokens 3"}
    )
    assert report.answer_stop == "tokens" and report.stopped in {"eos", "max_new_tokens"}
    generated = [g.token_id for g in report.generated]
    measured = report.answer_evidence.token_ids
    assert measured == (generated[:-1] if report.stopped == "eos" and len(generated) > 1 else generated)
    assert report.answer_evidence.covers.startswith(f"the model's generated answer, {len(measured)} token(s)")
    last = tool(inspector, {"model": "tiny-chat-llama", "prompt": CHAT})
    assert last.answer_evidence.covers.startswith("one token: the model's most likely next token")
    assert len(last.answer_evidence.tokens) == 1 and "one token" in last.summary


# --- template-inserted text -------------------------------------------------------------------------------------------
INSERTING_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<bos> system the cat sat on the mat <eos> {% endif %}" + CHAT_TEMPLATE
)


@pytest.fixture(scope="module")
def inserting_chat(tiny_models) -> LoadedModel:
    """The tiny chat model with a Qwen2-style template: a default system prompt when none is given."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = INSERTING_TEMPLATE
    return register_model("tiny-inserting-llama", copy.deepcopy(tiny_models["llama"].model), tokenizer)


def test_text_the_template_inserts_is_its_own_segment_and_reported_apart(inserting_chat, inspector: Inspector) -> None:
    tool = get_tool("trace_prompt_attention")
    user_only = [{"role": "user", "content": "the dog was tired"}, {"role": "assistant", "content": "it sat"}]
    report = tool(inspector, {"model": "tiny-inserting-llama", "prompt": user_only})
    inserted = next(s for s in report.segments if s.kind == "inserted")
    assert inserted.name == "inserted#1" and inserted.tier == "inserted" and inserted.text == "the cat sat on the mat"
    assert report.rendered_prompt.startswith("<bos> system the cat sat on the mat <eos>")
    assert inserted.causal is not None  # measured like any content ...
    assert report.depends_on_most in {"user#1", "assistant#1", None} and report.moves_most != "inserted#1"
    assert "None" not in report.summary and "'inserted#1' (inserted by the chat template, 6 tokens)" in report.summary
    with_system = [{"role": "system", "content": "the dog sat"}, *user_only]
    given = tool(inspector, {"model": "tiny-inserting-llama", "prompt": with_system})
    assert not any(s.kind == "inserted" for s in given.segments)
    comparison = get_tool("compare_prompts")(
        inspector, {"model": "tiny-inserting-llama", "prompt_a": with_system, "prompt_b": user_only}
    )
    assert comparison.inserted_a == [] and comparison.inserted_b == ["inserted#1"]
    assert "B's chat template inserted 'the cat sat on the mat' (6 tokens); the other variant did not get it" in (
        comparison.summary
    )
    assert "None" not in comparison.summary and "template_inserted" in {f.kind for f in comparison.findings}


# --- suggested calls are exact -----------------------------------------------------------------------------------
FEW_SHOT = "the cat sat\non the mat\n\nthe dog sat\non the mat\n\nthe cat was tired\nand the dog"
FEW_SHOT_SEGMENTS = [
    {"name": "ex1", "text": "the cat sat\non the mat"},
    {"name": "ex2", "text": "the dog sat\non the mat"},
    {"name": "query", "text": "the cat was tired\nand the dog"},
]


def test_suggested_calls_reproduce_the_texts_character_for_character(tiny_models, inspector: Inspector) -> None:
    arguments = {"model": "tiny-llama", "prompt": FEW_SHOT, "segments": FEW_SHOT_SEGMENTS}
    report = get_tool("trace_prompt_attention")(inspector, arguments)
    calls = {c.tool: c for c in report.next_calls}
    compare = calls["compare_prompts"]
    lead = report.moves_most
    cut = next(s["text"] for s in FEW_SHOT_SEGMENTS if s["name"] == lead)
    assert compare.arguments["prompt_a"] == FEW_SHOT
    assert compare.arguments["prompt_b"] == FEW_SHOT.replace(cut, "", 1)  # newlines kept, nothing joined on spaces
    followed = get_tool("compare_prompts")(inspector, compare.arguments)
    for variant, text in ((followed.trace_a, FEW_SHOT), (followed.trace_b, FEW_SHOT.replace(cut, "", 1))):
        (whole,) = [s for s in variant.segments if s.kind == "text"]  # each variant's text, newlines kept
        assert whole.text == text.replace("\n", "⏎") and len(text) < 80  # (shown whole under 80 characters)
        assert variant.num_tokens == inspector.encode(tiny_models["llama"], text).length
    gradient = get_tool("trace_prompt_attention")(
        inspector, {**calls["trace_prompt_attention"].arguments, "ig_steps": 4}
    )
    assert gradient.rendered_prompt == FEW_SHOT and [s.name for s in gradient.segments] == [
        s.name for s in report.segments
    ]
    assert "independent" not in calls["trace_prompt_attention"].why
    ablated = get_tool("ablate_heads")(inspector, calls["ablate_heads"].arguments)
    assert (
        calls["ablate_heads"].arguments["text"] == report.rendered_prompt == FEW_SHOT and ablated.model == "tiny-llama"
    )
