"""Write the tools' declarations as data (``agent_tools/tool_declarations.json``), which
:mod:`agent_tools.tool_declarations` reads without importing a tool, and size the output schemas they advertise.

    python -m agent_tools.surfaces.declarations           # rewrite the file from the registry (after a tool edit)
    python -m agent_tools.surfaces.declarations --check   # exit 1 when the file differs from the registry
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_tools.surfaces.portable import compact_schema
from agent_tools.tool_declarations import DECLARATIONS_FILE, json_type

if TYPE_CHECKING:
    from agent_tools.tools.registry import ToolSpec

# Bytes of one tool's advertised output schema: 18 tools (about 10 KB: the core fields, then the other top-level
# fields typed while they fit) keep ``tools/list`` under 32 KB with their inputs and descriptions (issue 28).
OUTPUT_SCHEMA_BUDGET = 550
# What every tool's advertised output schema keeps typed, whatever its budget: what an agent reads first.
CORE_REPORT_FIELDS = frozenset({"model", "summary", "findings", "next_calls", "omitted"})
_READER_ONLY = frozenset({"title", "description", "default", "examples"})


def output_schema(spec: ToolSpec, *, budget: int = OUTPUT_SCHEMA_BUDGET) -> dict[str, Any]:
    """The JSON schema of the tool's structured content (its report, serialised), sized for ``tools/list``.

    The full schema is 2 to 20 KB a tool (types, bounds, descriptions of every nested row), which an agent pays
    for on every turn; the SDK's client validates ``structuredContent`` against what is advertised, so the
    advertised schema must stay true. It is a looser schema, never a wrong one: every top-level field of the
    report with its type, bounds and enum; the fields of its rows (a list of per-head records, a nested object)
    with their types; deeper values typed as an object or a list. Titles, descriptions, defaults and ``required``
    go (the descriptions repeat the input's, or explain numbers the summary explains; the reports' fields are
    always present, and ``required`` repeated every name: 3 KB of the 18 tools' 18 KB). A value that may be null
    keeps its ``anyOf`` (a ``type`` list is shorter, but clients that map schemas onto a single-``type`` dialect
    reject it: the MCP Inspector warns, tests/test_mcp_inspector.py). When that is over
    ``budget`` bytes, the largest fields lose their row structure first, then the largest non-scalar fields
    leave, then the last scalars, until it fits; the core fields (model, summary, findings, next calls, omitted)
    always stay.
    """
    declared = spec.output_model.model_json_schema(mode="serialization")
    full = compact_schema(declared, drop=_READER_ONLY | {"required"})
    fields: dict[str, Any] = full.get("properties", {})
    shaped = {name: _with_row_types(sub) for name, sub in fields.items()}
    schema = {**full, "properties": shaped}
    coarse = {name: _value_type(sub) for name, sub in fields.items()}
    while _json_size(schema) > budget:
        candidates = [name for name in shaped if shaped[name] != coarse[name]]
        if not candidates:
            break
        largest = max(candidates, key=lambda name: _json_size(shaped[name]))
        shaped[largest] = coarse[largest]
    # Still over: the largest fields an agent reads least leave ``properties`` (still listed in ``required``, and
    # allowed because the schema then drops ``additionalProperties: false``): a looser schema, never a wrong one.
    # Then (a report of many numbers) its last scalars leave too, those that may be null first; the core fields
    # (model, summary, findings, next calls) always stay.
    while _json_size(schema) > budget:
        rest = [name for name in shaped if name not in CORE_REPORT_FIELDS]
        droppable = [name for name in rest if not _is_scalar(shaped[name])]
        if droppable:
            leaving = max(droppable, key=lambda name: (_json_size(shaped[name]), name))
        elif rest:
            leaving = max(rest, key=lambda name: ("null" in json.dumps(shaped[name]), rest.index(name)))
        else:
            break
        schema.pop("additionalProperties", None)
        del shaped[leaving]
    return schema


def _is_scalar(node: dict[str, Any]) -> bool:
    """A number, string, boolean or null (or a union of them): cheap to keep typed, and what agents compare."""
    kinds = [part for key in ("anyOf", "oneOf") for part in node.get(key, [])] or [node]
    scalar = {"integer", "number", "string", "boolean", "null"}

    def simple(kind: dict[str, Any]) -> bool:
        declared = kind.get("type")
        types = declared if isinstance(declared, list) else [declared]
        return "enum" in kind or all(t in scalar for t in types)

    return all(simple(kind) for kind in kinds)


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def _value_type(node: dict[str, Any]) -> dict[str, Any]:
    """A value's type, and for a list its items' type: a row's field, or a field past the budget."""
    if "anyOf" in node:
        return {"anyOf": [_value_type(branch) for branch in node["anyOf"]]}
    typed = json_type(node, choices=True)  # what a value is, and nothing about what it holds
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        typed["items"] = json_type(node["items"], choices=True)
    return typed


def _with_row_types(node: dict[str, Any]) -> dict[str, Any]:
    """A top-level field: scalars as declared; a list's rows and a nested object with their fields' types."""
    if "anyOf" in node:
        return {**node, "anyOf": [_with_row_types(branch) for branch in node["anyOf"]]}
    if isinstance(node.get("items"), dict):
        return {**node, "items": _with_row_types(node["items"])}
    if isinstance(node.get("properties"), dict):
        kept = {k: v for k, v in node.items() if k not in ("properties", "required", "additionalProperties")}
        return {**kept, "properties": {name: _value_type(sub) for name, sub in node["properties"].items()}}
    if isinstance(node.get("additionalProperties"), dict):
        return {**node, "additionalProperties": _value_type(node["additionalProperties"])}
    return node


def build_declarations() -> dict[str, Any]:
    """Every declared tool's data, from the live registry (imports the tools: torch, transformers)."""
    from agent_tools.surfaces.portable import portable_schema
    from agent_tools.tools import TOOLS

    tools = {
        name: {
            "description": spec.description,
            "example": spec.example,
            "arguments": [[field, info.is_required()] for field, info in spec.input_model.model_fields.items()],
            "advanced": list(spec.advanced),
            "input_schema": portable_schema(spec.input_model, "mcp"),
            "output_schema": output_schema(spec),
        }
        for name, spec in TOOLS.items()
    }
    return {"tools": tools}


def declarations_text(data: dict[str, Any]) -> str:
    """The file's text: one tool a block, stable across runs (reviewable diffs)."""
    return json.dumps(data, ensure_ascii=False, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from the registry")
    parser.add_argument("--out", type=Path, default=DECLARATIONS_FILE)
    args = parser.parse_args(argv)
    text = declarations_text(build_declarations())
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run python -m agent_tools.surfaces.declarations", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(text.encode()):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
