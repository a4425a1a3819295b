"""OpenAI-style function calling: the ``tools`` schemas of every declared tool and the dispatcher."""

from __future__ import annotations

import json

import jsonschema
import pytest

from agent_tools.inspector import Inspector
from agent_tools.loading import BUNDLED_MODELS, ModelPolicy
from agent_tools.prompts import system_prompt
from agent_tools.surfaces.openai import ToolDispatcher, openai_tools, parse_arguments
from agent_tools.tools import TOOLS, get_tool

SHOW = get_tool("show_attention")


def enum_of(schema: dict) -> list:
    """The allowed values a property states (directly, or in one branch of a union)."""
    variants = [schema, *schema.get("anyOf", ())]
    return next(v["enum"] if "enum" in v else [v["const"]] for v in variants if "enum" in v or "const" in v)


@pytest.mark.parametrize("strict", [False, True])
def test_every_tool_in_openai_format(strict: bool) -> None:
    declared = openai_tools(strict=strict)
    assert [d["function"]["name"] for d in declared] == list(TOOLS)
    for entry in declared:
        assert entry["type"] == "function"
        function = entry["function"]
        spec = TOOLS[function["name"]]
        assert function["description"] == spec.description
        assert function.get("strict", False) is strict
        parameters = function["parameters"]
        assert parameters["type"] == "object"
        # strict forms close every object; the plain form is open (it leaves advanced arguments out, and the
        # shared arguments' compact forms are looser than the tool: its validation refuses what they let through)
        if strict:
            assert parameters["additionalProperties"] is False
        else:
            assert "additionalProperties" not in parameters
        assert set(parameters["properties"]) <= set(spec.input_model.model_fields)
        assert {n for n, f in spec.input_model.model_fields.items() if f.is_required()} <= set(parameters["properties"])
        if strict:
            assert parameters["required"] == list(parameters["properties"])
        text = json.dumps(parameters)
        assert "$ref" not in text and "$defs" not in text  # self-contained for every provider
        jsonschema.Draft202012Validator.check_schema(parameters)
        if not strict:
            jsonschema.validate(spec.example, parameters)
        if "model" in parameters["properties"] and strict:  # the allow-list: strict forms keep every enum
            assert sorted(enum_of(parameters["properties"]["model"])) == sorted(BUNDLED_MODELS)
        elif "model" in parameters["properties"]:  # a string: the allow-list is the prompts' `model` line
            assert parameters["properties"]["model"] == {"type": "string"}


def test_selection_and_policy() -> None:
    policy = ModelPolicy(frozenset({"minilm-l6"}), "minilm-l6")
    (only,) = openai_tools(tools=["show_attention"], policy=policy, strict=True)
    assert enum_of(only["function"]["parameters"]["properties"]["model"]) == ["minilm-l6"]
    (plain,) = openai_tools(tools=["show_attention"], policy=policy)  # the choices are said in the system prompt
    assert plain["function"]["parameters"]["properties"]["model"] == {"type": "string"}
    assert "`model`: `minilm-l6` (default)." in system_prompt(tools=["show_attention"], policy=policy)
    refused = ToolDispatcher(Inspector(policy=policy), tools=["show_attention"]).dispatch(
        "show_attention", {"text": "a b", "layer": 0, "head": 0, "model": "/etc/passwd"}
    )  # what the plain schema lets through, the tool refuses before loading anything, naming the allowed ones
    assert refused["error"] == "model_refused" and "allowed: minilm-l6" in refused["message"]
    with pytest.raises(ValueError, match="unknown tool"):
        openai_tools(tools=["nope"])
    dispatcher = ToolDispatcher(tools=["show_attention"], strict=True)
    assert dispatcher.tools() == openai_tools(tools=["show_attention"], strict=True)


@pytest.mark.real_model
def test_dispatch_json_arguments_to_a_validated_report() -> None:
    dispatcher = ToolDispatcher()
    result = dispatcher.dispatch("show_attention", json.dumps(SHOW.example))
    report = SHOW.output_model.model_validate(result)
    assert report.layer == SHOW.example["layer"] and result["summary"].startswith("Layer 3 head 0")
    described = dispatcher.dispatch("describe_model", '{"model": "minilm-l6"}')
    assert described["num_layers"] == 6 and described["family"] == "bert"


@pytest.mark.real_model
def test_tool_message_for_a_provider_tool_call() -> None:
    dispatcher = ToolDispatcher(tools=["describe_model"])
    assert [d["function"]["name"] for d in dispatcher.tools()] == ["describe_model"]
    tool_call = {"id": "call_7", "type": "function", "function": {"name": "describe_model", "arguments": "{}"}}
    message = dispatcher.tool_message(tool_call)
    assert message["role"] == "tool" and message["tool_call_id"] == "call_7"
    content = message["content"]  # the concise text an LLM reads; the whole report comes from dispatch()
    assert len(content.encode()) <= 2048 and "num_heads=9" in content
    assert dispatcher.dispatch("describe_model", "{}")["num_heads"] == 9


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("show_attention", {**SHOW.example, "layer": 99}, "layer 99 out of range 0..29"),
        ("show_attention", {**SHOW.example, "top_k": 21}, "top_k 21 out of range 1..20"),
        ("show_attention", {**SHOW.example, "model": "../weights"}, "not allowed here; allowed: minilm-l6"),
        ("show_attention", "{not json", "arguments are not valid JSON"),
        ("show_attention", "[1, 2]", "arguments must be a JSON object"),
        ("no_such_tool", "{}", "unknown tool 'no_such_tool'; call one of: describe_model"),
    ],
)
def test_errors_are_objects_naming_what_is_valid(name, arguments, expected) -> None:
    result = ToolDispatcher().dispatch(name, arguments)
    assert set(result) == {"error", "message", "field"}
    assert expected in result["message"]


def test_bugs_raise(monkeypatch) -> None:
    from agent_tools.tools.registry import ToolSpec

    def broken(inspector, args):
        raise RuntimeError("a bug")

    describe = get_tool("describe_model")
    dispatcher = ToolDispatcher(Inspector(policy=ModelPolicy.bundled_only()), tools=["describe_model"])
    dispatcher.specs["describe_model"] = ToolSpec(
        "describe_model", "", describe.input_model, describe.output_model, broken, {}
    )
    with pytest.raises(RuntimeError, match="a bug"):
        dispatcher.dispatch("describe_model", {})


def test_parse_arguments() -> None:
    assert parse_arguments(None) == {} and parse_arguments("") == {}
    assert parse_arguments('{"a": 1}') == {"a": 1} and parse_arguments({"b": 2}) == {"b": 2}


# --- strict function calling and friendly head forms, on a tiny model -----------------------------------------
TINY_TEXT = "the cat sat on the mat because it was tired . the dog sat on the mat"


@pytest.fixture()
def tiny_dispatcher(tiny_models) -> ToolDispatcher:
    return ToolDispatcher(Inspector(policy=ModelPolicy(frozenset({"tiny-llama"}), "tiny-llama")))


def test_strict_calls_send_null_for_every_optional_argument_and_get_the_defaults(tiny_models) -> None:
    inspector = Inspector(policy=ModelPolicy(frozenset({"tiny-llama"}), "tiny-llama"))
    strict = ToolDispatcher(inspector, strict=True)
    plain = ToolDispatcher(inspector)
    for name, given in [
        ("show_attention", {"text": TINY_TEXT, "layer": 1, "head": 2}),
        ("ablate_heads", {"text": TINY_TEXT, "heads": ["1.0"]}),
        ("diagnose_collapse", {"text": TINY_TEXT}),
    ]:
        properties = strict.tools()[list(strict.specs).index(name)]["function"]["parameters"]["properties"]
        sent = {key: given.get(key) for key in properties}  # what a strict model sends: every key, null = not given
        assert None in sent.values()
        expected = plain.dispatch(name, given)
        assert "error" not in expected, expected
        assert strict.dispatch(name, json.dumps(sent)) == expected
        refused = plain.dispatch(name, sent)  # without strict, a null where a number belongs is an error
        assert refused["error"] == "invalid_input", (name, refused)


@pytest.mark.parametrize(
    "heads", [["1.0", "0.3"], [[1, 0], [0, 3]], [{"layer": 1, "head": 0}, {"layer": 0, "head": 3}]]
)
def test_every_head_form_gives_the_same_ablation(tiny_dispatcher, heads) -> None:
    result = tiny_dispatcher.dispatch("ablate_heads", {"text": TINY_TEXT, "heads": heads})
    reference = tiny_dispatcher.dispatch("ablate_heads", {"text": TINY_TEXT, "heads": "1.0, 0.3"})
    assert result["heads"] == ["1.0", "0.3"] and result == reference
    assert result["kl_last_position"] > 0


@pytest.mark.parametrize(
    ("heads", "expected"),
    [
        ([[1]], "heads[0] [1] is not a head"),
        ([18, 8], "[[18, 8]]"),
        ([{"layer": 1}], "heads[0] {'layer': 1} is not a head"),
        ([[1, 9]], "heads[0] head 9 out of range 0..3"),
    ],
)
def test_a_wrong_head_form_names_the_accepted_forms(tiny_dispatcher, heads, expected) -> None:
    result = tiny_dispatcher.dispatch("ablate_heads", {"text": TINY_TEXT, "heads": heads})
    assert result["error"] == "invalid_input" and expected in result["message"]
    if "out of range" not in expected:
        assert '"18.8"' in result["message"] and "[18, 8]" in result["message"] and '{"layer": 18' in result["message"]
    assert "HeadRef" not in result["message"] and "valid string" not in result["message"]  # no union dump
