"""OpenAI-style function calling: the ``tools`` schemas of every declared tool and the dispatcher."""

from __future__ import annotations

import json

import jsonschema
import pytest

from agent_tools.inspector import Inspector
from agent_tools.loading import BUNDLED_MODELS, ModelPolicy
from agent_tools.surfaces.openai import ToolDispatcher, dispatch, inline_refs, openai_tools, parse_arguments
from agent_tools.tools import TOOLS, get_tool

SHOW = get_tool("show_attention")


def test_every_tool_in_openai_format() -> None:
    declared = openai_tools()
    assert [d["function"]["name"] for d in declared] == list(TOOLS)
    for entry in declared:
        assert entry["type"] == "function"
        function = entry["function"]
        spec = TOOLS[function["name"]]
        assert function["description"] == spec.description
        parameters = function["parameters"]
        assert parameters["type"] == "object" and parameters["additionalProperties"] is False
        assert set(parameters["properties"]) == set(spec.input_model.model_fields)
        text = json.dumps(parameters)
        assert "$ref" not in text and "$defs" not in text  # self-contained for every provider
        jsonschema.Draft202012Validator.check_schema(parameters)
        jsonschema.validate(spec.example, parameters)
        if "model" in parameters["properties"]:
            assert sorted(parameters["properties"]["model"]["anyOf"][0]["enum"]) == sorted(BUNDLED_MODELS)


def test_selection_and_policy() -> None:
    declared = openai_tools(tools=["show_attention"], policy=ModelPolicy(frozenset({"minilm-l6"}), "minilm-l6"))
    (only,) = declared
    allowed = only["function"]["parameters"]["properties"]["model"]["anyOf"][0]
    assert allowed.get("enum", [allowed.get("const")]) == ["minilm-l6"]
    with pytest.raises(ValueError, match="unknown tool"):
        openai_tools(tools=["nope"])


def test_inline_refs_keeps_a_property_called_title() -> None:
    schema = {
        "$defs": {"Item": {"title": "Item", "type": "object", "properties": {"title": {"type": "string"}}}},
        "title": "Root",
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "title": "Items"}},
    }
    assert inline_refs(schema) == {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "object", "properties": {"title": {"type": "string"}}}}
        },
    }


@pytest.mark.real_model
def test_dispatch_json_arguments_to_a_validated_report() -> None:
    dispatcher = ToolDispatcher()
    result = dispatcher.dispatch("show_attention", json.dumps(SHOW.example))
    report = SHOW.output_model.model_validate(result)
    assert report.layer == SHOW.example["layer"] and result["summary"].startswith("Layer 3 head 0")
    described = json.loads(dispatcher.dispatch_json("describe_model", '{"model": "minilm-l6"}'))
    assert described["num_layers"] == 6 and described["family"] == "bert"


@pytest.mark.real_model
def test_tool_message_for_a_provider_tool_call() -> None:
    dispatcher = ToolDispatcher(tools=["describe_model"])
    assert [d["function"]["name"] for d in dispatcher.tools()] == ["describe_model"]
    tool_call = {"id": "call_7", "type": "function", "function": {"name": "describe_model", "arguments": "{}"}}
    message = dispatcher.tool_message(tool_call)
    assert message["role"] == "tool" and message["tool_call_id"] == "call_7"
    assert json.loads(message["content"])["num_heads"] == 9


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("show_attention", {**SHOW.example, "layer": 99}, "layer 99 out of range 0..29"),
        ("show_attention", {**SHOW.example, "top_k": 21}, "top_k: Input should be less than or equal to 20"),
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


@pytest.mark.real_model
def test_one_shot_dispatch() -> None:
    assert dispatch("describe_model", {"model": "minilm-l6"})["num_kv_heads"] == 12
