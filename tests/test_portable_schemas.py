"""Every tool's input schema in every provider flavour: OpenAI strict, Gemini function declarations, MCP.

The rules are checked by walking each schema, OpenAI's strict form against the openai package's own converter
(a strict schema is a fixed point of it), and each tool's example is carried through every flavour.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import pytest
from openai.lib._pydantic import _ensure_strict_json_schema
from pydantic import BaseModel, Field

from agent_tools.analysis.heads import DEFAULT_THRESHOLDS, HEAD_ROLES
from agent_tools.errors import InvalidInputError
from agent_tools.loading import ModelPolicy
from agent_tools.surfaces import agent_input_model, agent_input_schema
from agent_tools.surfaces.portable import (
    FLAVOURS,
    GEMINI_KEYWORDS,
    STRICT_KEYWORDS,
    accepts_null,
    inline_refs,
    portable_schema,
    restore_omitted,
)
from agent_tools.tool_declarations import SHARED_ARGUMENTS, json_type
from agent_tools.tools import TOOLS
from agent_tools.tools.profile_heads.models import ProfileHeadsInput, RoleThresholds

BUNDLED = ModelPolicy.bundled_only()
# the model as an agent sees it (model narrowed to an enum) and as the command line declares it
MODELS = {f"{name}/{kind}": (name, kind) for name in TOOLS for kind in ("agent", "declared")}


def input_model(key: str) -> type[BaseModel]:
    name, kind = MODELS[key]
    spec = TOOLS[name]
    return agent_input_model(spec, BUNDLED) if kind == "agent" else spec.input_model


def nodes(schema: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node (not the property-name maps themselves) with its path."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from nodes(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from nodes(schema["items"], f"{path}[]")
    for index, sub in enumerate(schema.get("anyOf", ())):
        yield from nodes(sub, f"{path}|{index}")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from nodes(schema["additionalProperties"], f"{path}{{}}")


def nulls_for_omitted(value: Any, schema: dict[str, Any]) -> Any:
    """What a strict model sends for ``value``: every optional property it left out, as null (at any depth)."""
    variants = [schema, *schema.get("anyOf", ())]
    if isinstance(value, dict):
        chosen = next(v for v in variants if "properties" in v and set(value) <= set(v["properties"]))
        return {
            name: nulls_for_omitted(value[name], sub) if name in value else None
            for name, sub in chosen["properties"].items()
        }  # (an example holding an argument the schema does not show fails here: no agent could send it)
    if isinstance(value, list):
        items = next(v["items"] for v in variants if "items" in v)
        return [nulls_for_omitted(item, items) for item in value]
    return value


def gemini_as_json_schema(schema: Any) -> Any:
    """Gemini's OpenAPI-style ``nullable`` written back as JSON Schema, to validate examples against it."""
    if isinstance(schema, list):
        return [gemini_as_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: gemini_as_json_schema(v) for k, v in schema.items() if k != "nullable"}
    if "properties" in schema:
        out["properties"] = {k: gemini_as_json_schema(v) for k, v in schema["properties"].items()}
    return {"anyOf": [out, {"type": "null"}]} if schema.get("nullable") else out


# --- every tool, every flavour ------------------------------------------------------------------------------
@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("key", MODELS)
def test_no_refs_titles_or_defs_in_any_flavour(key: str, flavour) -> None:
    schema = portable_schema(input_model(key), flavour)
    assert schema["type"] == "object" and "anyOf" not in schema
    for path, node in nodes(schema):
        assert not {"$ref", "$defs", "definitions"} & set(node), path
        assert not isinstance(node.get("title"), str), path


@pytest.mark.parametrize("key", MODELS)
def test_mcp_flavour_is_the_model_schema_inlined_and_the_example_validates(key: str) -> None:
    model = input_model(key)
    schema = portable_schema(model, "mcp")
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(TOOLS[MODELS[key][0]].example, schema)
    shown = schema["properties"]  # the agent's model leaves its tool's advanced arguments out
    assert set(shown) <= set(model.model_fields) and (
        MODELS[key][1] == "agent" or set(shown) == set(model.model_fields)
    )
    assert schema.get("required", []) == [n for n, f in model.model_fields.items() if f.is_required() and n in shown]


@pytest.mark.parametrize("key", MODELS)
def test_openai_strict_rules_hold(key: str) -> None:
    model = input_model(key)
    plain = portable_schema(model, "mcp")
    schema = portable_schema(model, "openai-strict")
    jsonschema.Draft202012Validator.check_schema(schema)
    for path, node in nodes(schema):
        assert set(node) <= STRICT_KEYWORDS, (path, set(node) - STRICT_KEYWORDS)
        assert "default" not in node
        if node.get("type") == "object":
            assert node["additionalProperties"] is False, path
            assert node["required"] == list(node["properties"]), path
    # optional arguments are nullable (null = "not given"); required ones keep their own type
    for name, sub in schema["properties"].items():
        if name not in plain.get("required", ()):
            assert accepts_null(sub), name
        else:
            assert accepts_null(sub) == accepts_null(plain["properties"][name]), name


def depth(schema: dict[str, Any]) -> int:
    """Levels of object nesting (the root object is 1)."""
    items = [schema["items"]] if isinstance(schema.get("items"), dict) else []
    children = [*schema.get("properties", {}).values(), *schema.get("anyOf", ()), *items]
    return (schema.get("type") == "object") + max((depth(child) for child in children), default=0)


@pytest.mark.parametrize("key", MODELS)
def test_openai_strict_limits(key: str) -> None:
    """OpenAI's limits on a strict schema: at most 5 levels of nesting and 100 properties in all (the older,
    tighter limits), enums of at most 500 values."""
    schema = portable_schema(input_model(key), "openai-strict")
    assert depth(schema) <= 5
    assert sum(len(n.get("properties", {})) for _, n in nodes(schema)) <= 100
    assert all(len(n.get("enum", ())) <= 500 for _, n in nodes(schema))


@pytest.mark.parametrize("key", MODELS)
def test_openai_strict_is_unchanged_by_the_openai_packages_converter(key: str) -> None:
    schema = portable_schema(input_model(key), "openai-strict")
    converted = copy.deepcopy(schema)
    assert _ensure_strict_json_schema(converted, path=(), root=converted) == schema


@pytest.mark.parametrize("key", MODELS)
def test_openai_strict_example_round_trips_to_the_same_arguments(key: str) -> None:
    """The example as a strict model sends it (every optional argument null) validates against the strict schema,
    and back through :func:`restore_omitted` it is the very same validated input as the plain example."""
    model = input_model(key)
    example = TOOLS[MODELS[key][0]].example
    strict_call = nulls_for_omitted(example, portable_schema(model, "mcp"))
    assert set(strict_call) == set(portable_schema(model, "openai-strict")["properties"])
    jsonschema.validate(strict_call, portable_schema(model, "openai-strict"))
    assert model.model_validate(restore_omitted(strict_call, model)) == model.model_validate(example)


GEMINI_FORBIDDEN = {"exclusiveMinimum", "exclusiveMaximum", "propertyNames", "additionalProperties", "const"}


@pytest.mark.parametrize("key", MODELS)
def test_gemini_function_declaration_rules_hold(key: str) -> None:
    schema = portable_schema(input_model(key), "gemini")
    for path, node in nodes(schema):
        assert set(node) <= GEMINI_KEYWORDS, (path, set(node) - GEMINI_KEYWORDS)
        assert not GEMINI_FORBIDDEN & set(node), path
        if "anyOf" not in node:
            assert isinstance(node.get("type"), str) and node["type"] != "null", path
        if "enum" in node:
            assert node["type"] == "string" and all(isinstance(v, str) for v in node["enum"]), path
        if node.get("type") == "array":
            assert isinstance(node.get("items"), dict), path
        if node.get("type") == "object":
            assert node.get("properties"), path  # Gemini refuses an object without properties
    checked = gemini_as_json_schema(schema)
    jsonschema.Draft202012Validator.check_schema(checked)
    jsonschema.validate(TOOLS[MODELS[key][0]].example, checked)


# --- what agents are shown: the shared arguments' compact forms ----------------------------------------------
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}]
SPANS = [{"name": "doc", "text": "Paris", "occurrence": 1}, {"name": "ask", "start": 0, "end": 5, "message": 1}]
# Every form of every shared argument (tool_declarations.SHARED_ARGUMENTS) the tools accept: each branch of a union,
# each way to write a head or a segment, each choice.
SHARED_VALUES: dict[str, list[Any]] = {
    "detail": ["summary", "full"],
    "model": sorted(BUNDLED.allowed or ()),
    "text": ["The cat sat on the mat."],
    "layer": [0],
    "head": [1],
    "layers": [[0, 1]],
    "heads": [["0.1", "L0H1", "0.*", "0:1", [0, 1], {"layer": 0, "head": 1}]],
    "prompt": ["Where is Paris?", CHAT],
    "prompt_a": ["Where is Paris?", CHAT],
    "prompt_b": ["Where is Rome?", CHAT],
    "segments": [SPANS],
    "answer": [" Paris"],
    "wrong": [" Rome"],
    "target_token": [" Paris"],
    "resample_text": ["A dog ran in the park."],
    "target": ["last", "generate"],
    "checks": [["causal", "gradient", "value"], []],
    "attention": ["self", "encoder", "decoder", "cross"],
}


OWN_KEYWORDS = ("description", "default", "minItems", "maxItems", "minimum", "maximum")  # what a tool says of one


def test_every_shared_argument_has_its_values_here() -> None:
    assert set(SHARED_VALUES) == SHARED_ARGUMENTS


@pytest.mark.parametrize("name", list(TOOLS))
def test_what_agents_are_shown_accepts_every_form_the_tool_accepts(name: str) -> None:
    """The advertised schema is looser than the tool, never stricter: every value of a shared argument that the
    tool's validation takes (each chat-message, head and segment form, each choice) validates against what the
    agent is shown, for every policy (``attention`` is shown where a model may have several stacks)."""
    spec = TOOLS[name]
    for policy in (BUNDLED, ModelPolicy(None)):
        shown = agent_input_schema(spec, policy)
        jsonschema.Draft202012Validator.check_schema(shown)
        assert "additionalProperties" not in shown  # open: the tool's validation names what it refuses
        for argument in SHARED_ARGUMENTS & set(shown["properties"]):
            taken = 0
            for value in SHARED_VALUES[argument]:
                arguments = {**spec.example, argument: value}
                try:
                    spec.parse(arguments)
                except InvalidInputError:
                    continue  # another argument of the example rules this value out (a segment to move, ...)
                jsonschema.validate(arguments, shown)
                taken += 1
            assert taken, (argument, "no form of it was tried")
            if argument != "model":  # (the model's choices are the session's: the instructions' `model` line)
                declared = portable_schema(spec.input_model, "mcp")["properties"][argument]
                own = {k: v for k, v in declared.items() if k in OWN_KEYWORDS}
                assert shown["properties"][argument] == {**json_type(declared), **own}, argument


# --- the converters on constructed models -------------------------------------------------------------------
class Inner(BaseModel):
    name: str = Field(min_length=1, max_length=40)
    weight: float = Field(default=0.5, gt=0, le=1)


class Constructed(BaseModel):
    count: int = Field(default=5, gt=0, description="how many")
    mode: Literal["fast"] = "fast"
    inner: Inner | None = None
    items: list[Inner] = Field(default_factory=list)
    label: str | None = Field(default="x", description="null is a value of its own here")


def test_strict_form_of_a_constructed_model() -> None:
    schema = portable_schema(Constructed, "openai-strict")
    assert schema["required"] == ["count", "mode", "inner", "items", "label"]
    assert schema["properties"]["count"] == {
        "anyOf": [{"exclusiveMinimum": 0, "type": "integer"}, {"type": "null"}],
        "description": "how many (null = the default 5)",
    }
    assert schema["properties"]["label"] == {
        "anyOf": [{"type": "string"}, {"type": "null"}],
        "description": 'null is a value of its own here (default "x")',
    }
    inner = schema["properties"]["inner"]["anyOf"][0]
    assert inner["required"] == ["name", "weight"] and inner["additionalProperties"] is False
    assert inner["properties"]["name"] == {
        "type": "string",
        "description": "at most 40 characters; at least 1 character",
    }
    assert inner["properties"]["weight"]["anyOf"][0] == {"exclusiveMinimum": 0, "maximum": 1, "type": "number"}


def test_gemini_form_of_a_constructed_model() -> None:
    schema = portable_schema(Constructed, "gemini")
    assert schema["properties"]["count"] == {
        "default": 5, "minimum": 1, "type": "integer", "description": "how many"
    }  # fmt: skip
    assert schema["properties"]["mode"] == {"default": "fast", "enum": ["fast"], "type": "string"}
    inner = schema["properties"]["inner"]
    assert inner["nullable"] is True and inner["type"] == "object" and "additionalProperties" not in inner
    assert inner["properties"]["weight"] == {
        "default": 0.5, "minimum": 0, "maximum": 1, "type": "number", "description": "greater than 0"
    }  # fmt: skip
    assert inner["properties"]["name"] == {"maxLength": 40, "minLength": 1, "type": "string"}


def test_restore_omitted_keeps_nulls_that_mean_something() -> None:
    sent = {"count": None, "mode": None, "inner": {"name": "a", "weight": None}, "items": [], "label": None}
    restored = restore_omitted(sent, Constructed)
    assert restored == {"inner": {"name": "a"}, "items": [], "label": None}
    parsed = Constructed.model_validate(restored)
    assert parsed.count == 5 and parsed.inner is not None and parsed.inner.weight == 0.5 and parsed.label is None


class WithMap(BaseModel):
    scores: dict[str, float]


class Node(BaseModel):
    children: list[Node] = Field(default_factory=list)


@pytest.mark.parametrize("flavour", ["openai-strict", "gemini"])
def test_a_map_has_no_strict_or_gemini_form(flavour) -> None:
    with pytest.raises(ValueError, match=r"scores: .*map"):
        portable_schema(WithMap, flavour)
    assert portable_schema(WithMap, "mcp")["properties"]["scores"]["additionalProperties"] == {"type": "number"}


def test_a_recursive_model_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="Node -> Node: a recursive schema"):
        portable_schema(Node, "mcp")


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


# --- profile_heads' thresholds: an object with one optional property per role ---------------------------------
def test_thresholds_are_one_property_per_role_and_the_map_input_still_works() -> None:
    assert tuple(RoleThresholds.model_fields) == HEAD_ROLES
    for flavour in FLAVOURS:
        thresholds = portable_schema(ProfileHeadsInput, flavour)["properties"]["thresholds"]
        objects = [n for _, n in nodes(thresholds) if n.get("type") == "object"]
        assert [list(o["properties"]) for o in objects] == [list(HEAD_ROLES)]
    parsed = ProfileHeadsInput.model_validate({"thresholds": {"induction": 0.2, "self": 0.45}})
    assert parsed.thresholds is not None and parsed.thresholds.given() == {"induction": 0.2, "self": 0.45}
    with pytest.raises(ValueError, match="inductoin"):
        ProfileHeadsInput.model_validate({"thresholds": {"inductoin": 0.2}})
    with pytest.raises(ValueError, match="less than 1"):
        ProfileHeadsInput.model_validate({"thresholds": {"induction": 1.0}})


def test_thresholds_reach_the_report(tiny_models, inspector) -> None:
    arguments = {"model": "tiny-llama", "text": "the cat sat on the mat", "seeds": 1, "probe_length": 8}
    report = TOOLS["profile_heads"](inspector, {**arguments, "thresholds": {"induction": 0.95, "local": 0.05}})
    assert report.thresholds["induction"] == 0.95 and report.thresholds["local"] == 0.05
    assert report.thresholds["previous_token"] == DEFAULT_THRESHOLDS["previous_token"]
    local = next(r for r in report.roles if r.role == "local")
    qualifying = sum(1 for p in report.heads if p.scores.get("local", 0) >= 0.05)
    assert local.heads_with_role == qualifying > 0
