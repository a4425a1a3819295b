"""A tool's input model as a JSON schema each provider accepts as it is.

Pydantic writes full JSON Schema (2020-12): ``$ref``/``$defs``, ``exclusiveMinimum``, ``propertyNames``,
``minLength``, titles, defaults. Providers accept different subsets, so :func:`portable_schema` writes one
flavour per family of clients:

- ``"mcp"``: the schema with every ``$ref`` inlined (no ``$defs``), titles dropped and a string ``enum`` or
  ``const`` without its ``"type": "string"`` (the choices alone say it; the other flavours write the type) — the
  declared form (``tool_declarations.json``, what ``call`` checks). What an MCP client reads as ``inputSchema``,
  also the plain OpenAI-style ``parameters``, is this with the shared arguments as their JSON types
  (:func:`agent_tools.surfaces.agent_input_schema`; the prompts define their forms once).
- ``"openai-strict"``: OpenAI strict function calling (``"strict": true``): every object closed
  (``additionalProperties: false``) with every property required, an optional property nullable (the model
  sends ``null`` for "not given"; :func:`restore_omitted` turns those nulls back into the defaults), no
  ``default`` and only the keywords strict mode supports; the others (a default, a string's length) move into
  the description, so the model still reads them.
- ``"gemini"``: Gemini function declarations (an OpenAPI 3.0 subset): no ``$ref``, no ``additionalProperties``
  (no map-typed objects: a map would need one optional property per key), no ``propertyNames``, no
  ``exclusiveMinimum``/``exclusiveMaximum`` (written as ``minimum``/``maximum`` with the strict bound in the
  description), ``nullable`` instead of a ``null`` type, ``enum`` instead of ``const``.

A model that cannot be written in a flavour (a map in strict or Gemini form, a recursive model) raises
``ValueError`` naming the path: the declaration is the bug, not the caller's input.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, get_args

from pydantic import BaseModel

Flavour = Literal["openai-strict", "gemini", "mcp"]
FLAVOURS: tuple[Flavour, ...] = get_args(Flavour)

# OpenAI strict mode: the keywords it supports (https://platform.openai.com/docs/guides/structured-outputs).
STRICT_KEYWORDS = frozenset(
    {
        "type", "description", "properties", "required", "additionalProperties", "items", "anyOf", "enum", "const",
        "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "minItems", "maxItems",
    }
)  # fmt: skip
STRICT_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"})
# Gemini's ``Schema`` object (function declarations' ``parameters``).
GEMINI_KEYWORDS = frozenset(
    {
        "type", "format", "title", "description", "nullable", "enum", "maxItems", "minItems", "properties",
        "required", "minProperties", "maxProperties", "minLength", "maxLength", "pattern", "example", "anyOf",
        "propertyOrdering", "default", "items", "minimum", "maximum",
    }
)  # fmt: skip
GEMINI_FORMATS = {"string": {"enum", "date-time"}, "integer": {"int32", "int64"}, "number": {"float", "double"}}
# Constraints a flavour cannot state as a keyword: said in words in the description instead.
_IN_WORDS = {
    "minLength": ("at least", "character"),
    "maxLength": ("at most", "character"),
    "minItems": ("at least", "item"),
    "maxItems": ("at most", "item"),
    "minProperties": ("at least", "property"),
    "maxProperties": ("at most", "property"),
    "multipleOf": ("a multiple of", ""),
    "uniqueItems": ("items unique", ""),
}


def _say(keyword: str, value: Any) -> str:
    """A constraint keyword in words: ``minLength: 1`` -> "at least 1 character"."""
    words, unit = _IN_WORDS[keyword]
    if keyword == "uniqueItems":
        return words
    if not unit:
        return f"{words} {value}"
    plural = "" if value == 1 else ("ies" if unit.endswith("y") else "s")
    return f"{words} {value} {unit[:-1] + plural if plural == 'ies' else unit + plural}"


def portable_schema(model: type[BaseModel], flavour: Flavour) -> dict[str, Any]:
    """``model``'s JSON schema in the given flavour (see the module docstring); a new dict on every call."""
    if flavour == "mcp":
        return compact_schema(model.model_json_schema(), recursive="raise", untyped_choices=True)
    schema = inline_refs(model.model_json_schema())
    if flavour == "openai-strict":
        return _strict(schema, "")
    if flavour == "gemini":
        return _gemini(schema, "")
    raise ValueError(f"unknown schema flavour {flavour!r}; flavours: {', '.join(FLAVOURS)}")


_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "dependentSchemas"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SCHEMA_VALUES = frozenset({"items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else"})


def compact_schema(
    schema: dict[str, Any],
    *,
    drop: frozenset[str] = frozenset({"title"}),
    recursive: Literal["keep", "raise"] = "keep",
    untyped_choices: bool = False,
) -> dict[str, Any]:
    """``schema`` with its local ``$ref`` s inlined and the keywords in ``drop`` removed (annotations such as
    titles and descriptions: the same instances stay valid); a new dict.

    Keywords are recognised by position (``properties`` holds names, not keywords), so a report field called
    ``description`` stays. A recursive definition is kept as a reference (under ``$defs``), or with
    ``recursive="raise"`` refused with a ``ValueError`` naming the cycle (it has no ``$ref``-free form).
    ``untyped_choices`` drops ``"type": "string"`` beside an ``enum`` or ``const`` of strings (JSON Schema: the
    choices alone constrain the value; 16 bytes each, about 40 in the tools' declarations). The one ``$ref``
    inliner of the project: every flavour here and the MCP output schemas use it. Nullable fields stay ``anyOf``
    branches of one ``type`` each (a ``type`` list is less portable: the MCP Inspector flags it, Gemini's dialect
    rejects it).
    """
    definitions: dict[str, Any] = schema.get("$defs", {})
    referenced: set[str] = set()  # the recursive definitions, kept as references

    def walk(node: Any, expanding: tuple[str, ...]) -> Any:
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.rsplit("/", 1)[-1]
            rest = {k: v for k, v in node.items() if k != "$ref"}
            if name in expanding and recursive == "raise":
                raise ValueError(f"{' -> '.join((*expanding, name))}: a recursive schema has no $ref-free form")
            if name in referenced or name in expanding:
                referenced.add(name)
                return {"$ref": ref, **keywords(rest, expanding)}
            return walk({**definitions[name], **rest}, (*expanding, name))
        return keywords(node, expanding)

    def keywords(node: dict[str, Any], expanding: tuple[str, ...]) -> dict[str, Any]:
        choices = node["enum"] if isinstance(node.get("enum"), list) else [node["const"]] if "const" in node else None
        untyped = untyped_choices and choices is not None and all(isinstance(c, str) for c in choices)
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in drop or key == "$defs" or (key == "type" and value == "string" and untyped):
                continue
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {name: walk(sub, expanding) for name, sub in value.items()}
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                out[key] = [walk(sub, expanding) for sub in value]
            elif key in _SCHEMA_VALUES and isinstance(value, dict):
                out[key] = walk(value, expanding)
            else:
                out[key] = value
        return out

    result: dict[str, Any] = walk(schema, ())
    kept: dict[str, Any] = {}
    while pending := sorted(referenced - set(kept)):  # a kept definition may reference further recursive ones
        for name in pending:
            kept[name] = walk(definitions[name], (name,))
    if kept:
        result["$defs"] = kept
    return result


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema with local ``#/$defs/...`` references replaced by their definitions and titles removed
    (a property *named* ``title`` stays). A recursive definition cannot be inlined and raises ``ValueError``."""
    return compact_schema(schema, recursive="raise")


def accepts_null(schema: Mapping[str, Any]) -> bool:
    """Whether ``null`` validates against this (inlined) schema node."""
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind) or schema.get("nullable") is True:
        return True
    if None in schema.get("enum", ()) or ("const" in schema and schema["const"] is None):
        return True
    return any(accepts_null(variant) for variant in schema.get("anyOf", ()))


def _in_words(notes: list[str], description: str | None) -> str | None:
    if not notes:
        return description
    said = "; ".join(notes)
    return f"{description} ({said})" if description else said


# --- OpenAI strict ----------------------------------------------------------------------------------------------
def _strict(node: dict[str, Any], path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in node.items():
        if key == "default":
            if value is not None:  # where null is a value of its own, it cannot also mean the default
                shown = json.dumps(value, ensure_ascii=False)
                notes.append(f"default {shown}" if accepts_null(node) else f"null = the default {shown}")
        elif key == "format" and value not in STRICT_FORMATS:
            continue
        elif key in STRICT_KEYWORDS:
            out[key] = value
        elif key in _IN_WORDS:
            notes.append(_say(key, value))
        else:
            raise ValueError(f"{path or 'the root'}: keyword {key!r} has no OpenAI strict form")
    if out.get("type") == "object" or "properties" in out:
        extra = out.get("additionalProperties", False)
        if extra is not False:
            msg = f"{path or 'the root'}: a map (additionalProperties {extra!r}) has no strict form; declare properties"
            raise ValueError(msg)
        properties: dict[str, Any] = out.get("properties", {})
        required = set(out.get("required", ()))
        out["properties"] = {
            name: (_strict if name in required else _strict_optional)(schema, f"{path}.{name}".lstrip("."))
            for name, schema in properties.items()
        }
        out["required"] = list(properties)
        out["additionalProperties"] = False
    if isinstance(out.get("items"), dict):
        out["items"] = _strict(out["items"], f"{path}[]")
    if "anyOf" in out:
        out["anyOf"] = [_strict(variant, f"{path}|{i}") for i, variant in enumerate(out["anyOf"])]
    description = _in_words(notes, out.pop("description", None))
    return {**out, "description": description} if description else out


def _strict_optional(node: dict[str, Any], path: str) -> dict[str, Any]:
    """An optional property in strict form: required, and nullable so that ``null`` can mean "not given"."""
    strict = _strict(node, path)
    if accepts_null(strict):
        return strict
    description = strict.pop("description", None)
    if "anyOf" in strict and len(strict) == 1:
        nullable: dict[str, Any] = {"anyOf": [*strict["anyOf"], {"type": "null"}]}
    else:
        nullable = {"anyOf": [strict, {"type": "null"}]}
    return {**nullable, "description": description} if description else nullable


# --- Gemini -----------------------------------------------------------------------------------------------------
def _gemini(node: dict[str, Any], path: str) -> dict[str, Any]:
    where = path or "the root"
    node = dict(node)
    nullable = False
    kind = node.get("type")
    if isinstance(kind, list):  # ["string", "null"]
        kinds = [k for k in kind if k != "null"]
        nullable = len(kinds) < len(kind)
        if len(kinds) != 1:
            raise ValueError(f"{where}: a type list {kind} has no Gemini form; use anyOf")
        node["type"] = kinds[0]
    if "anyOf" in node:
        union = node.pop("anyOf")
        variants = [v for v in union if v.get("type") != "null"]
        nullable = nullable or len(variants) < len(union)
        if len(variants) == 1:  # X | None: X itself, nullable; the outer description and default win
            node = {**variants[0], **node}
        else:
            node["anyOf"] = variants
    if node.get("type") == "null":
        raise ValueError(f"{where}: a schema of type null alone has no Gemini form")
    if "const" in node:
        node["enum"] = [node.pop("const")]
    out: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in node.items():
        if key in {"exclusiveMinimum", "exclusiveMaximum"}:
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            step = 1 if node.get("type") == "integer" else 0
            out[bound] = value + step if bound == "minimum" else value - step
            if not step:
                notes.append(f"{'greater' if bound == 'minimum' else 'less'} than {value}")
        elif key == "additionalProperties":
            if value is not False:
                msg = f"{where}: a map (additionalProperties {value!r}) has no Gemini form; declare properties"
                raise ValueError(msg)
        elif key == "propertyNames":
            raise ValueError(f"{where}: propertyNames (a map) has no Gemini form; declare properties")
        elif key == "format":
            if value in GEMINI_FORMATS.get(str(node.get("type")), ()):
                out[key] = value
        elif key == "default" and value is None:
            continue
        elif key in GEMINI_KEYWORDS:
            out[key] = value
        elif key in _IN_WORDS:
            notes.append(_say(key, value))
        else:
            raise ValueError(f"{where}: keyword {key!r} has no Gemini form")
    if "enum" in out and not all(isinstance(v, str) for v in out["enum"]):
        raise ValueError(f"{where}: Gemini enums are strings only, got {out['enum']}")
    if "enum" in out:
        out["type"] = "string"
    if isinstance(out.get("properties"), dict):
        out["properties"] = {
            name: _gemini(schema, f"{path}.{name}".lstrip(".")) for name, schema in out["properties"].items()
        }
    if isinstance(out.get("items"), dict):
        out["items"] = _gemini(out["items"], f"{path}[]")
    if "anyOf" in out:
        out["anyOf"] = [_gemini(variant, f"{path}|{i}") for i, variant in enumerate(out["anyOf"])]
    if nullable:
        out["nullable"] = True
    description = _in_words(notes, out.pop("description", None))
    return {**out, "description": description} if description else out


# --- back from a strict call ------------------------------------------------------------------------------------
def restore_omitted(arguments: Mapping[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """A strict call's arguments as the model's own validation expects them: the ``null`` a strict model sends
    for an optional argument it does not want (at any depth) is dropped, so the argument takes its default.

    A ``null`` stays where it means something of its own: a required argument, or an optional one whose default
    is not ``null`` but which accepts ``null`` as a value.
    """
    restored = _drop_nulls(dict(arguments), inline_refs(model.model_json_schema()))
    assert isinstance(restored, dict)
    return restored


def _variants(schema: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [schema, *(v for variant in schema.get("anyOf", ()) for v in _variants(variant))]


def _drop_nulls(value: Any, schema: Mapping[str, Any]) -> Any:
    if isinstance(value, dict):
        objects = [v for v in _variants(schema) if isinstance(v.get("properties"), dict)]
        if not objects:
            return value
        chosen = max(objects, key=lambda o: len(set(value) & set(o["properties"])))  # the first of the best
        properties, required = chosen["properties"], set(chosen.get("required", ()))
        kept = {}
        for name, item in value.items():
            field = properties.get(name)
            if field is None:  # not in the schema (an argument it does not show): left to validation
                kept[name] = item
                continue
            means_null = accepts_null(field) and field.get("default") is not None
            if item is None and name not in required and not means_null:
                continue
            kept[name] = _drop_nulls(item, field)
        return kept
    if isinstance(value, list):
        items = next((v["items"] for v in _variants(schema) if isinstance(v.get("items"), dict)), None)
        return value if items is None else [_drop_nulls(item, items) for item in value]
    return value
