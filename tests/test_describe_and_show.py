"""describe_model and show_attention end to end, their bad inputs, and that nothing is left altered."""

from __future__ import annotations

import math

import pytest
import torch
from reference import SAMPLE_TEXT

from agent_tools.errors import AttentionToolError, InvalidInputError, ModelNotFoundError, ResourceLimitError
from agent_tools.inspector import Inspector
from agent_tools.tools import TOOLS, get_tool
from agent_tools.tools.describe_model import ModelDescription
from agent_tools.tools.show_attention import AttentionView


def test_describe_tiny_families(tiny_models, inspector: Inspector) -> None:
    described = {n: get_tool("describe_model")(inspector, {"model": f"tiny-{n}"}) for n in tiny_models}
    assert described["llama"].num_kv_heads == 2 and described["llama"].kv_groups == 2
    assert described["bert"].causal is False and described["gpt2"].causal is True
    assert "learned absolute" in described["gpt2"].positional
    assert "25%" in described["gpt_neox"].positional
    assert described["gemma2"].scaling_ratio == pytest.approx(math.sqrt(8) / 4, abs=1e-4)
    assert described["gemma2"].softcap == 2.0
    assert described["mistral"].sliding_window == 4
    assert described["opt"].query_prescaled is True


@pytest.mark.real_model
def test_describe_default_model(smol, inspector: Inspector) -> None:
    report = get_tool("describe_model")(inspector, {})
    assert isinstance(report, ModelDescription)
    assert (report.num_layers, report.num_heads, report.num_kv_heads, report.head_dim) == (30, 9, 3, 64)
    assert report.scaling == pytest.approx(0.125) and report.scaling_ratio == 1.0
    assert report.positional == "rotary (RoPE)" and report.causal and report.max_positions == 8192
    assert 130e6 < report.num_parameters < 140e6


@pytest.mark.real_model
def test_show_attention_rows_match_the_captured_map(smol, inspector: Inspector) -> None:
    report = get_tool("show_attention")(
        inspector, {"text": SAMPLE_TEXT, "layer": 3, "head": 0, "top_k": 2, "include_map": True, "png": True}
    )
    assert isinstance(report, AttentionView)
    weights = torch.tensor(report.weights)
    length = len(report.tokens)
    assert weights.shape == (length, length)
    assert torch.allclose(weights.sum(-1), torch.ones(length), atol=1e-4)
    assert weights.triu(1).abs().max() == 0  # causal
    for row in report.rows:
        best = row.top_keys[0]
        assert best.weight == pytest.approx(weights[row.position].max().item(), abs=1e-4)
        assert best.position <= row.position
    assert report.kv_head == 0 and report.png_path and report.png_path.endswith(".png")
    assert report.tokens[1].text == " cat"


def test_show_attention_encoder(tiny_models, inspector: Inspector) -> None:
    report = get_tool("show_attention")(inspector, {"model": "tiny-bert", "text": "the cat sat", "layer": 1, "head": 3})
    assert len(report.rows) == 4 and report.tokens[0].special  # <bos> from the tiny tokenizer
    assert all(0 <= r.entropy <= math.log(4) + 1e-6 for r in report.rows)


def test_special_tokens_read_whatever_the_query_are_named_sinks() -> None:
    from agent_tools.schemas import Token
    from agent_tools.tools.show_attention.plan import _sinks

    words = ["[CLS]", "a", "b", "[SEP]"]
    keys = [Token(position=i, text=w, token_id=i, special=w.startswith("[")) for i, w in enumerate(words)]
    weights = torch.tensor(
        [[1.0, 0.0, 0.0, 0.0], [0.5, 0.2, 0.1, 0.2], [0.6, 0.1, 0.1, 0.2], [0.4, 0.2, 0.2, 0.2]]
    )  # (q, k), every key visible
    allowed = torch.ones(4, 4, dtype=torch.bool)
    # [CLS] from the other three queries: (0.5 + 0.6 + 0.4) / 3 = 0.5 ≥ 10% and ≥ 2 × 1/4; [SEP]: 0.4 / 3 < 2 × 1/4
    assert _sinks(weights, allowed, keys, same_tokens=True) == ((0, "[CLS]", pytest.approx(0.5)),)


@pytest.mark.real_model
def test_show_attention_on_the_encoder_names_its_sink_and_every_query(minilm, inspector: Inspector) -> None:
    from agent_tools.surfaces import concise_text

    report = get_tool("show_attention")(
        inspector, {"model": "minilm-l6", "text": "The cat sat on the mat.", "layer": 3, "head": 0}
    )
    sinks = [f for f in report.findings if f.kind == "sink"]
    assert [(f.position, f.token) for f in sinks] == [(0, "[CLS]")] and "'[CLS]' is a sink" in report.summary
    text = concise_text(report)
    for row in report.rows:  # 9 queries: each one's top keys fit in the text
        assert f"- query {row.position} {row.token!r} reads {row.top_keys[0].position} " in text


BAD_CASES = [
    ({"text": "", "layer": 0, "head": 0}, InvalidInputError, "empty"),
    ({"text": "   \n\t", "layer": 0, "head": 0}, InvalidInputError, "empty"),
    ({"text": "the cat", "layer": 2, "head": 0}, InvalidInputError, r"layer 2 out of range 0\.\.1"),
    ({"text": "the cat", "layer": -1, "head": 0}, InvalidInputError, r"out of range 0\.\.1"),
    ({"text": "the cat", "layer": 0, "head": 4}, InvalidInputError, r"head 4 out of range 0\.\.3"),
    ({"text": "the cat", "layer": "x", "head": 0}, InvalidInputError, "layer"),
    ({"text": "the cat", "layer": 0, "head": 0, "colour": 1}, InvalidInputError, "unknown argument 'colour'"),
    ({"text": "the cat " * 40, "layer": 0, "head": 0}, ResourceLimitError, "at most 64 tokens"),
    ({"text": "x" * 100_000, "layer": 0, "head": 0}, ResourceLimitError, "token limit of 64"),
    ({"text": "bad \ud800 surrogate", "layer": 0, "head": 0}, InvalidInputError, "not valid Unicode"),
]


@pytest.mark.parametrize(("arguments", "error", "message"), BAD_CASES)
def test_bad_input_is_a_clear_error_and_changes_nothing(tiny_models, inspector, arguments, error, message) -> None:
    model = tiny_models["llama"].model
    ids = torch.arange(6, 14)[None]
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    with pytest.raises(error, match=message):
        get_tool("show_attention")(inspector, {"model": "tiny-llama", **arguments})
    with torch.inference_mode():
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    assert model.config._attn_implementation == "eager"


def test_unknown_model_and_tool() -> None:
    inspector = Inspector()
    with pytest.raises(ModelNotFoundError, match="bundled aliases"):
        get_tool("describe_model")(inspector, {"model": "no-such-model"})
    with pytest.raises(AttentionToolError, match="unknown tool 'nope'; tools: describe_model"):
        get_tool("nope")


def test_every_tool_declares_typed_input_and_output() -> None:
    for name, spec in TOOLS.items():
        assert spec.name == name and spec.description
        assert "properties" in spec.input_model.model_json_schema()
        assert {"summary", "findings", "model"} <= set(spec.output_model.model_json_schema()["properties"])
