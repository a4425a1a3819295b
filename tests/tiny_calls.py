"""A tool's example call moved onto the tiny registered model: the arguments the reliability and the LangChain
standard tests run every tool with."""

from __future__ import annotations

from typing import Any

from agent_tools.loading import LoadedModel
from agent_tools.tools import TOOLS

TINY = "tiny-llama"
TINY_TEXT = "the cat sat on the mat because it was tired . the dog sat on the mat"


def tiny_arguments(name: str, loaded: LoadedModel) -> dict[str, Any]:
    """The tool's example, moved onto the tiny model (indices clipped into its range, text swapped)."""
    arguments: dict[str, Any] = dict(TOOLS[name].example)
    if "model" in TOOLS[name].input_model.model_fields:
        arguments["model"] = TINY
    facts = loaded.facts
    for key, value in list(arguments.items()):
        if key in {"text", "prompt", "prompt_a", "prompt_b"}:  # plain text: the tiny tokenizer has no chat template
            arguments[key] = TINY_TEXT if key != "prompt_b" else TINY_TEXT.replace("dog", "cat")
        elif key == "layer":
            arguments[key] = min(int(value), facts.num_layers - 1)
        elif key == "head":
            arguments[key] = min(int(value), facts.num_heads - 1)
        elif key == "layers" and isinstance(value, list):
            arguments[key] = sorted({min(int(v), facts.num_layers - 1) for v in value})
        elif key == "heads" and isinstance(value, list):
            arguments[key] = [clip_head(v, facts) for v in value][:1]
        elif key == "max_new_tokens":
            arguments[key] = min(int(value), 3)
        elif key in {"sink", "window"}:  # a short cache the tiny text outlasts
            arguments[key] = 1 if key == "sink" else 4
        elif key == "context_length":
            arguments[key] = min(int(value), facts.max_positions or int(value))
        elif key == "lengths":
            arguments[key] = [min(int(v), 48) for v in value]
    if name == "position_sensitivity":  # movable pieces of the tiny text
        pieces = [{"name": "first", "text": "the cat sat"}, {"name": "second", "text": "the dog sat"}]
        arguments.update(segments=pieces, move="second", answer="mat")
    return arguments


def clip_head(value: Any, facts: Any) -> Any:
    """A head reference ("L.H" or {layer, head}) clipped into the model's range."""
    if isinstance(value, str) and "." in value:
        layer, head = value.split(".")
        return f"{min(int(layer), facts.num_layers - 1)}.{min(int(head), facts.num_heads - 1)}"
    if isinstance(value, dict):
        return {
            "layer": min(int(value["layer"]), facts.num_layers - 1),
            "head": min(int(value["head"]), facts.num_heads - 1),
        }
    return value
