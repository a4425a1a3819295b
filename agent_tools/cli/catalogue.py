"""The tools' arguments without torch: a cached catalogue for ``call TOOL --help`` and checks before loading.

Importing the tools imports torch and transformers (about 5 s on a 2-core machine), so ``call`` would spend
that long before it could say that ``layr`` is not an argument. The catalogue holds what the command line needs
to answer first — each tool's description, example and input schema (the ``mcp`` flavour: ``$ref``-free) — as
JSON in the cache folder, keyed on the package's source files (their paths, sizes and modification times), so
an edited tool is read again. The first ``call`` after a change builds it (it imports the tools anyway).

Standard library only at import time.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

from agent_tools.errors import InvalidInputError
from agent_tools.settings import cache_dir

PACKAGE = Path(__file__).resolve().parent.parent
FORMAT = 1


def source_key() -> str:
    """A digest of every source file of the package (path, size, mtime) and the Python version."""
    digest = hashlib.sha256(f"{FORMAT}|{sys.version_info[:2]}|{PACKAGE}".encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(PACKAGE)}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


def catalogue_path(key: str | None = None) -> Path:
    return cache_dir() / f"tool-catalogue-{key or source_key()}.json"


def load_catalogue() -> dict[str, Any] | None:
    """The catalogue of this very source, or None (not built yet, or unreadable)."""
    try:
        data = json.loads(catalogue_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("tools"), dict) else None


def build_catalogue() -> dict[str, Any]:
    """Every declared tool's description, example and input schema (imports the tools: torch, transformers)."""
    from agent_tools.surfaces.portable import portable_schema
    from agent_tools.tools import TOOLS

    tools = {
        name: {
            "description": spec.description,
            "example": spec.example,
            "schema": portable_schema(spec.input_model, "mcp"),
        }
        for name, spec in TOOLS.items()
    }
    return {"format": FORMAT, "tools": tools}


def save_catalogue(data: dict[str, Any]) -> None:
    """Write the catalogue atomically; a cache folder that cannot be written only costs speed next time."""
    path = catalogue_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        os.replace(partial, path)
        for old in path.parent.glob("tool-catalogue-*.json"):
            if old != path:
                old.unlink(missing_ok=True)
    except OSError:
        pass


def catalogue(*, build: bool) -> dict[str, Any] | None:
    """The current catalogue; built (and saved) when missing if ``build``, else None."""
    data = load_catalogue()
    if data is None and build:
        data = build_catalogue()
        save_catalogue(data)
    return data


# --- reading a schema -------------------------------------------------------------------------------------------
def type_text(schema: dict[str, Any]) -> str:
    """A schema as a short type: ``integer``, ``"zero" | "mean"``, ``list of (string | [integer, integer])``."""
    if "enum" in schema:
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"], ensure_ascii=False)
    if "anyOf" in schema:
        return " | ".join(type_text(v) for v in schema["anyOf"] if v.get("type") != "null")
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items", {})
        if items.get("type") in {"integer", "number"} and schema.get("minItems") == schema.get("maxItems") is not None:
            return "[" + ", ".join([items["type"]] * int(schema["maxItems"])) + "]"
        inner = type_text(items) if items else "any"
        return f"list of ({inner})" if " | " in inner else f"list of {inner}"
    if kind == "object":
        properties = schema.get("properties")
        return "{" + ", ".join(properties) + "}" if properties else "object"
    return str(kind or "any")


def _bounds(schema: dict[str, Any], low: str, high: str, unit: str = "") -> list[str]:
    lower = schema.get(low)
    upper = schema.get(high)
    if lower is not None and upper is not None:
        return [f"{unit}{lower}..{upper}"]
    if lower is not None:
        return [f"{unit}≥ {lower}"]
    if upper is not None:
        return [f"{unit}≤ {upper}"]
    return []


def range_text(schema: dict[str, Any]) -> str:
    """The valid range a schema states: ``1..20``, ``> 0, ≤ 1``, ``length ≤ 500``, ``1+ items``."""
    parts: list[str] = []
    for node in [schema, *schema.get("anyOf", ())]:
        bounds = _bounds(node, "minimum", "maximum")
        if "exclusiveMinimum" in node or "exclusiveMaximum" in node:
            if "exclusiveMinimum" in node:
                bounds = [f"> {node['exclusiveMinimum']}"] + [b for b in bounds if not b.startswith("≥")]
            if "exclusiveMaximum" in node:
                bounds = [b for b in bounds if not b.startswith("≤")] + [f"< {node['exclusiveMaximum']}"]
        parts += bounds
        parts += _bounds(node, "minLength", "maxLength", "length ")
        if node.get("type") == "array" and node.get("minItems") != node.get("maxItems"):
            parts += _bounds(node, "minItems", "maxItems", "items ")
    return ", ".join(parts)


def arguments_table(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per argument: name, type, required, default, range, description."""
    required = set(schema.get("required", ()))
    rows = []
    for name, field in schema.get("properties", {}).items():
        rows.append(
            {
                "name": name,
                "type": type_text(field),
                "required": name in required,
                "default": field.get("default"),
                "range": range_text(field),
                "description": field.get("description", ""),
            }
        )
    return rows


def tool_help(name: str, entry: dict[str, Any], *, width: int = 100) -> str:
    """``call TOOL --help``: the description, every argument (type, default, range, description), the example."""
    lines = [f"attention-explainer call {name} --json ARGS", ""]
    lines += textwrap.wrap(entry["description"], width)
    lines += ["", "arguments (a JSON object; ARGS may also be @file.json or - for stdin):"]
    for row in arguments_table(entry["schema"]):
        if row["required"]:
            given = "required"
        else:
            given = "optional" if row["default"] is None else f"default {json.dumps(row['default'])}"
        facts = [row["type"], given]
        if row["range"]:
            facts.append(row["range"])
        lines.append(f"  {row['name']}: " + ", ".join(facts))
        lines += textwrap.wrap(row["description"], width, initial_indent="      ", subsequent_indent="      ")
    example = json.dumps(entry["example"], ensure_ascii=False)
    lines += ["", "example:", f"  attention-explainer call {name} --json '{example}'"]
    return "\n".join(lines)


def tools_help(tools: dict[str, Any], *, width: int = 100) -> str:
    """``call --help``: the usage and each tool with the first sentence of its description."""
    lines = ["attention-explainer call TOOL --json ARGS   (attention-explainer call TOOL --help: its arguments)", ""]
    for name, entry in tools.items():
        first = entry["description"].split(". ")[0].rstrip(".")
        lines += textwrap.wrap(f"{name}: {first}.", width, subsequent_indent="    ")
    return "\n".join(lines)


# --- checks before the model loads ------------------------------------------------------------------------------
def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _bound_problem(name: str, value: Any, schema: dict[str, Any]) -> str | None:
    """A number out of its bounds, in the words the tools use: ``NAME VALUE out of range LO..HI`` when both bounds
    are inclusive (as the inspector says it), pydantic's words otherwise (so every surface reads alike)."""
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None and high is not None and not low <= value <= high:
        return f"{name} {value!r} out of range {low}..{high}"
    checks = (
        ("minimum", lambda v, b: v >= b, "greater than or equal to"),
        ("exclusiveMinimum", lambda v, b: v > b, "greater than"),
        ("maximum", lambda v, b: v <= b, "less than or equal to"),
        ("exclusiveMaximum", lambda v, b: v < b, "less than"),
    )
    for keyword, holds, words in checks:
        if keyword in schema and not holds(value, schema[keyword]):
            return f"{name}: Input should be {words} {schema[keyword]} (got {value!r})"
    return None


def precheck(name: str, arguments: Any, schema: dict[str, Any]) -> list[str]:
    """What is certainly wrong with ``arguments`` by the schema alone: unknown or missing arguments, a choice not
    among the allowed ones, a number out of range. Anything subtler (types pydantic converts, the heads grammar,
    layer ranges of the model) is left to the tool's own validation, which follows."""
    if not isinstance(arguments, dict):
        return []
    properties: dict[str, Any] = schema.get("properties", {})
    problems = []
    for key in arguments:
        if key not in properties:
            close = difflib.get_close_matches(key, properties, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(f"unknown argument {key!r} ({hint}arguments: {', '.join(properties)})")
    for key in schema.get("required", ()):
        if key not in arguments:
            problems.append(f"{key}: Field required (see attention-explainer call {name} --help)")
    for key, value in arguments.items():
        field = properties.get(key)
        if field is None or value is None:
            continue
        variants = [field, *field.get("anyOf", ())]
        enums = [v["enum"] for v in variants if "enum" in v]
        if enums and isinstance(value, str) and not any(value in e for e in enums):
            allowed = " or ".join(repr(v) for e in enums for v in e)
            problems.append(f"{key}: Input should be {allowed} (got {value!r})")
        numeric = [v for v in variants if v.get("type") in {"integer", "number"}]
        if _number(value) and len(numeric) == 1:
            problem = _bound_problem(key, value, numeric[0])
            if problem:
                problems.append(problem)
    return problems


def check_arguments(name: str, arguments: Any, entry: dict[str, Any]) -> None:
    """Raise the one-line error naming every certain problem (before torch is imported or a model loaded)."""
    problems = precheck(name, arguments, entry["schema"])
    if problems:
        raise InvalidInputError(f"invalid arguments for {name}: " + "; ".join(problems))


def unknown_tool(name: str, tools: dict[str, Any]) -> InvalidInputError:
    close = difflib.get_close_matches(name, tools, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return InvalidInputError(f"unknown tool {name!r}; {hint}tools: {', '.join(tools)}", field="name")
