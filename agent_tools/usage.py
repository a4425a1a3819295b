"""How a value an agent sent should have been written: the fix its error message names (standard library only).

Shared by the command line's checks before a model loads (:mod:`agent_tools.cli.catalogue`) and the tools' own
validation on every surface (:func:`agent_tools.tools.registry.format_validation_error`), so that ``"head":
"18,6"`` gets the same "looks like layer 18, head 6" wherever it is sent.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

INTEGER = re.compile(r"^\s*[+-]?\d+\s*$")
HEAD_PAIR = re.compile(r"^\s*[Ll]?(\d+)\s*[,.:;/ hH]\s*[Hh]?(\d+)\s*$")  # "18,6", "18.6", "L18H6"


def shown(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def type_fix(key: str, value: Any, field: dict[str, Any]) -> str:
    """What to send instead, where the mistake is recognisable: ``'18,6'`` for a head, ``'18'`` for a list."""
    variants = [field, *field.get("anyOf", ())]
    kinds = {v.get("type") for v in variants}
    if isinstance(value, str) and (pair := HEAD_PAIR.match(value)) and key in ("layer", "head", "heads"):
        layer, head = int(pair.group(1)), int(pair.group(2))
        if key in ("layer", "head"):
            return f'{value!r} looks like layer {layer}, head {head}: use "layer": {layer}, "head": {head}'
        return f'{value!r} looks like layer {layer}, head {head}: use "heads": ["{layer}.{head}"]'
    arrays = [v for v in variants if v.get("type") == "array"]
    if arrays and not isinstance(value, list):
        item = arrays[0].get("items", {})
        parts = [p for p in re.split(r"[,\s]+", value.strip())] if isinstance(value, str) else [value]
        if item.get("type") == "integer" and all(isinstance(p, int) or INTEGER.match(str(p)) for p in parts if p != ""):
            listed = [int(p) for p in parts if p != ""]
            return f"{shown(value)} -> {json.dumps(listed)} (a list)"
        if isinstance(value, str | int):
            return f"{shown(value)} -> [{shown(value)}] (a list)"
    if "integer" in kinds and isinstance(value, float):
        return f"a whole number, e.g. {math.floor(value)}"
    if "integer" in kinds and isinstance(value, list) and len(value) == 1 and isinstance(value[0], int):
        return f"{shown(value)} -> {shown(value[0])} (one number, not a list)"
    if "string" in kinds and not isinstance(value, str) and value is not None:
        return f"a string, e.g. {json.dumps(str(value))}"
    return ""


def long_text_advice(limit: int) -> str:
    """What to do with a text over the token limit (said alike before the model loads and by the inspector)."""
    return (
        f"cut it to the part the question is about (at most {limit:,} tokens, roughly {limit * 4:,} characters of "
        "English, e.g. its last paragraphs). The per-layer tools (show_attention, diagnose_collapse, "
        "explain_scaling, attention_rollout, profile_heads) stream texts up to that limit one layer at a time; "
        "trace_prompt_attention, compare_prompts and patch_heads run extra passes per segment or head, so keep "
        "their texts short"
    )
