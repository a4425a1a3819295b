"""The tools' arguments without torch: the catalogue ``call TOOL --help`` and the checks before loading read.

Importing the tools imports torch and transformers (about 5 s on a 2-core machine), so ``call`` would spend
that long before it could say that ``layr`` is not an argument. What the command line needs to answer first —
each tool's description, example and input schema (the ``mcp`` flavour: ``$ref``-free) — is in the tools'
declaration data (:mod:`agent_tools.tool_declarations`, generated from the registry and checked equal to it by
``tests/test_mcp_startup.py``), which the MCP server reads for ``tools/list`` too: nothing to build or cache.

Standard library only at import time.
"""

from __future__ import annotations

import difflib
import json
import math
import textwrap
from pathlib import Path
from typing import Any

from agent_tools.errors import InvalidInputError
from agent_tools.policy import ModelPolicy
from agent_tools.prompts import shared_arguments
from agent_tools.settings import DEFAULT_MODEL, cache_dir
from agent_tools.tool_declarations import model_choices
from agent_tools.usage import HEAD_PAIR, INTEGER, long_text_advice, shown, type_fix


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
        if "exclusiveMinimum" in node:
            bounds = [f"> {node['exclusiveMinimum']}"] + [b for b in bounds if not b.startswith("≥")]
        if "exclusiveMaximum" in node:
            bounds = [b for b in bounds if not b.startswith("≤")] + [f"< {node['exclusiveMaximum']}"]
        parts += bounds
        parts += _bounds(node, "minLength", "maxLength", "length ")
        if node.get("type") == "array" and node.get("minItems") != node.get("maxItems"):
            parts += _bounds(node, "minItems", "maxItems", "items ")
    return ", ".join(parts)


def tool_help(name: str, entry: dict[str, Any], *, width: int = 100) -> str:
    """``call TOOL --help``: the description, every argument (type, default, range, description), the example."""
    lines = [f"attention-explainer call {name} --json ARGS", ""]
    lines += textwrap.wrap(entry["description"], width)
    lines += ["", "arguments (a JSON object; ARGS may also be @file.json or - for stdin):"]
    properties: dict[str, Any] = entry["input_schema"].get("properties", {})
    required = set(entry["input_schema"].get("required", ()))
    for argument, field in properties.items():
        default = field.get("default")
        if argument in required:
            given = "required"
        else:
            given = "optional" if default is None else f"default {json.dumps(default)}"
        facts = [type_text(field), given, range_text(field)]
        lines.append(f"  {argument}: " + ", ".join(filter(None, facts)))
        lines += textwrap.wrap(field.get("description", ""), width, initial_indent="      ", subsequent_indent="      ")
    lines_for_any_model = shared_arguments(models=model_choices(ModelPolicy()))  # ``call`` takes any reference
    shared = [line for line in lines_for_any_model if any(f"`{argument}`" in line for argument in properties)]
    if shared:  # what the arguments every tool repeats mean, said once (the prompts' "Arguments")
        lines += ["", "shared arguments:"]
        lines += [wrapped for line in shared for wrapped in textwrap.wrap(line, width, subsequent_indent="    ")]
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


# Fields whose integers index a model's layers or heads (every tool names them so), checked against the model's
# facts when the catalogue knows them; and the fields that hold a text the model reads.
LAYER_FIELDS = frozenset({"layer", "layers", "up_to_layer"})
HEAD_FIELDS = frozenset({"head"})
HEAD_LIST_FIELDS = frozenset({"heads"})
TEXT_FIELDS = frozenset({"text", "prompt", "prompt_a", "prompt_b", "clean", "corrupted"})
CHARS_PER_TOKEN_CEILING = 64  # as the inspector: a text longer than limit·64 characters cannot fit
_BOOL_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "t", "f", "y", "n", "1", "0"})


def _accepts(value: Any, schema: dict[str, Any]) -> bool:
    """Whether the tool's (lax) validation could take ``value`` for this schema node: only a certain refusal is
    reported before the model loads ("18" for an integer is taken, "18,6" is not)."""
    variants = schema.get("anyOf")
    if variants:
        return any(_accepts(value, v) for v in variants)
    if "enum" in schema or "const" in schema:
        return True  # choices are checked (and named) on their own
    kind = schema.get("type")
    if kind is None:
        return True
    if kind == "null":
        return value is None
    if isinstance(value, bool):
        return kind == "boolean"
    if kind == "integer":
        if isinstance(value, float):
            return value.is_integer()
        return isinstance(value, int) or (isinstance(value, str) and bool(INTEGER.match(value)))
    if kind == "number":
        if isinstance(value, int | float):
            return True
        try:
            return isinstance(value, str) and math.isfinite(float(value))
        except ValueError:
            return False
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return value in (0, 1) or (isinstance(value, str) and value.strip().lower() in _BOOL_WORDS)
    if kind == "array":
        if not isinstance(value, list):
            return False
        items = schema.get("items")
        return not isinstance(items, dict) or all(_accepts(item, items) for item in value[:256])
    if kind == "object":
        return isinstance(value, dict)
    return True


def precheck(name: str, arguments: Any, schema: dict[str, Any], *, facts: dict[str, Any] | None = None) -> list[str]:
    """What is certainly wrong with ``arguments`` by the schema alone: unknown or missing arguments, a value of a
    type the tool cannot read, a choice not among the allowed ones, a number out of range, and — when ``facts``
    (the model's ``layers``, ``heads``, ``positions``) are known — a layer or head past the model's and a text
    longer than it can read. Each names the valid form and, where the mistake is recognisable, the fix. Anything
    subtler (the heads grammar, duplicates, token counts) is left to the tool's own validation, which follows."""
    if not isinstance(arguments, dict):
        return [f'the arguments must be a JSON object, e.g. {{"text": "..."}}; got {type(arguments).__name__}']
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
            continue
        if not _accepts(value, field):
            fix = type_fix(key, value, field)
            problems.append(f"{key}: expected {type_text(field)}, got {shown(value)}" + (f"; {fix}" if fix else ""))
            continue
        numeric = [v for v in variants if v.get("type") in {"integer", "number"}]
        if _number(value) and len(numeric) == 1:
            problem = _bound_problem(key, value, numeric[0])
            if problem:
                problems.append(problem)
                continue
        if facts:
            problems += _model_problems(key, value, facts)
    return problems


def _index(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and INTEGER.match(value):
        return int(value)
    return None


def _model_problems(key: str, value: Any, facts: dict[str, Any]) -> list[str]:
    """Layer and head indices past the model's, texts longer than it reads (``facts``: layers, heads, positions)."""
    layers, heads, positions = facts.get("layers"), facts.get("heads"), facts.get("positions")
    where = f" ({facts['name']})" if facts.get("name") else ""
    problems = []

    def out_of(index: Any, count: int | None, what: str, label: str) -> None:
        number = _index(index)
        if count and number is not None and not 0 <= number < count:
            problems.append(f"{label} {number} out of range 0..{count - 1}{where}: the model has {count} {what}")

    if key in LAYER_FIELDS and key != "layers":
        if not (key == "up_to_layer" and _index(value) == -1):
            out_of(value, layers, "layers", key)
    elif key == "layers" and isinstance(value, list):
        for item in value:
            out_of(item, layers, "layers", "layers item")
    elif key in HEAD_FIELDS:
        out_of(value, heads, "heads per layer", key)
    elif key in HEAD_LIST_FIELDS and isinstance(value, list):
        for item in value:
            if isinstance(item, int):
                out_of(item, heads, "heads per layer", "heads item")
            elif isinstance(item, list) and len(item) == 2:
                out_of(item[0], layers, "layers", "layer")
                out_of(item[1], heads, "heads per layer", "head")
            elif isinstance(item, dict):
                out_of(item.get("layer"), layers, "layers", "layer")
                out_of(item.get("head"), heads, "heads per layer", "head")
            elif isinstance(item, str) and (pair := HEAD_PAIR.match(item)):
                out_of(pair.group(1), layers, "layers", "layer")
                out_of(pair.group(2), heads, "heads per layer", "head")
    elif key in TEXT_FIELDS and isinstance(value, str) and positions:
        ceiling = positions * CHARS_PER_TOKEN_CEILING
        if len(value) > ceiling:
            too_long = f"{key} of {len(value):,} characters is longer than the model reads"
            problems.append(f"{too_long} ({positions:,} tokens at most): {long_text_advice(positions)}")
    return problems[:3]


# Facts of the bundled models (layers, heads per layer, positions), so that ranges are checked before the first
# load; a model loaded once by ``call`` is remembered in the cache folder (``remember_facts``).
KNOWN_FACTS: dict[str, dict[str, int]] = {
    "smollm2-135m-instruct": {"layers": 30, "heads": 9, "positions": 8192},
    "minilm-l6": {"layers": 6, "heads": 12, "positions": 512},
}
FACTS_FILE = "model-facts.json"


def _facts_path() -> Path:
    return cache_dir() / FACTS_FILE


def remember_facts(reference: str, facts: dict[str, int]) -> None:
    """Keep a loaded model's facts for the next ``call``'s checks (best effort: a read-only cache costs nothing)."""
    from agent_tools.files import write_atomic  # loaded by the call that ran the model: the checks do without it

    path = _facts_path()
    try:
        known = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        if not isinstance(known, dict) or known.get(reference) == facts:
            return
        known[reference] = facts
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(known))
    except (OSError, ValueError):
        pass


def model_facts(reference: str | None) -> dict[str, Any] | None:
    """Layers, heads and positions of a model, without torch: remembered from an earlier load, read from a local
    folder's ``config.json``, or a bundled model's; None when unknown (or when it has more than one stack)."""
    ref = (reference or DEFAULT_MODEL).strip() or DEFAULT_MODEL
    try:
        remembered = json.loads(_facts_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        remembered = {}
    if isinstance(remembered, dict) and isinstance(remembered.get(ref), dict):
        return {"name": ref, **remembered[ref]}
    if ref in KNOWN_FACTS:
        return {"name": ref, **KNOWN_FACTS[ref]}
    config = Path(ref).expanduser() / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("is_encoder_decoder"):
        return None
    data = data.get("text_config", data) if isinstance(data.get("text_config"), dict) else data

    def first(*names: str) -> int | None:
        found = next((data[n] for n in names if isinstance(data.get(n), int)), None)
        return found if isinstance(found, int) else None

    facts = {
        "layers": first("num_hidden_layers", "n_layer", "num_layers"),
        "heads": first("num_attention_heads", "n_head", "num_heads"),
        "positions": first("max_position_embeddings", "n_positions", "n_ctx"),
    }
    return {"name": ref, **{k: v for k, v in facts.items() if v}} if facts["layers"] or facts["heads"] else None


def check_arguments(name: str, arguments: Any, entry: dict[str, Any], *, token_limit: int | None = None) -> None:
    """Raise the one-line error naming every certain problem (before torch is imported or a model loaded);
    ``token_limit`` is the session's own limit on texts, when it set one."""
    model = arguments.get("model") if isinstance(arguments, dict) else None
    facts = model_facts(model) if model is None or isinstance(model, str) else None
    if facts is not None and token_limit:
        facts["positions"] = min(token_limit, facts.get("positions") or token_limit)
    if isinstance(arguments, dict) and arguments.get("attention") not in (None, "self"):
        facts = None  # another stack of an encoder-decoder: its own depth
    problems = precheck(name, arguments, entry["input_schema"], facts=facts)
    if problems:
        raise InvalidInputError(f"invalid arguments for {name}: " + "; ".join(problems))


def unknown_tool(name: str, tools: dict[str, Any]) -> InvalidInputError:
    close = difflib.get_close_matches(name, tools, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return InvalidInputError(f"unknown tool {name!r}; {hint}tools: {', '.join(tools)}", field="name")
