"""OpenAI-style function calling without LangChain: the ``tools`` list and a dispatcher for tool calls.

    from agent_tools.surfaces.openai import ToolDispatcher, openai_tools

    dispatcher = ToolDispatcher()                       # bundled models only; default model by default
    response = client.chat.completions.create(model=..., messages=messages, tools=openai_tools())
    for call in response.choices[0].message.tool_calls or []:
        messages.append(dispatcher.tool_message(call))  # {"role": "tool", "tool_call_id": ..., "content": JSON}

The schemas are the tools' pydantic input models with ``$ref``s inlined and titles dropped (portable across
providers that accept OpenAI-style declarations), the arguments the tools share as their JSON types: their forms
and the models allowed are in the system prompt's "Arguments" (``system_prompt(policy=...)``), and the tools
validate them as before. ``openai_tools(strict=True)`` / ``ToolDispatcher(strict=True)`` give and serve every form
in OpenAI's strict form (see :mod:`agent_tools.surfaces.portable`). A result is the report
as JSON; a failure the agent can fix is ``{"error": kind, "message": ..., "field": ...}`` with a message naming
what is valid. Bugs raise.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from agent_tools.errors import AttentionToolError, InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.loading import ModelPolicy
from agent_tools.placement import make_placement
from agent_tools.schemas import Report
from agent_tools.surfaces import agent_input_model, agent_input_schema, concise_text, error_text, select_tools
from agent_tools.surfaces.portable import portable_schema, restore_omitted

__all__ = ["ToolDispatcher", "openai_tools", "parse_arguments"]


def openai_tools(
    *, tools: Iterable[str] | None = None, policy: ModelPolicy | None = None, strict: bool = False
) -> list[dict[str, Any]]:
    """Every declared tool (or the named subset) in the OpenAI ``tools`` format.

    ``policy``: the models allowed (default: the bundled ones), an enum in the strict form; the plain form shows
    ``model`` as a string, the choices being the system prompt's (``system_prompt(policy=policy)``).
    ``strict=True`` declares each function ``"strict": true`` with its schema in strict form (every property
    required, the optional ones nullable); serve its calls with ``ToolDispatcher(strict=True)``, which reads a
    ``null`` for an optional argument as "not given".
    """
    policy = policy or ModelPolicy.bundled_only()
    declared = []
    for spec in select_tools(tools):
        function: dict[str, Any] = {"name": spec.name, "description": spec.description}
        if strict:
            function["strict"] = True
            function["parameters"] = portable_schema(agent_input_model(spec, policy), "openai-strict")
        else:
            function["parameters"] = agent_input_schema(spec, policy)
        declared.append({"type": "function", "function": function})
    return declared


class ToolDispatcher:
    """Executes tool calls by name with JSON arguments, through one inspector (its policy is the allow-list)."""

    def __init__(
        self,
        inspector: Inspector | None = None,
        *,
        tools: Iterable[str] | None = None,
        strict: bool = False,
        **placement: Any,
    ) -> None:
        """``placement`` keywords (``dtype``, ``device``, ``device_map``, ``max_memory``, ``offload_folder``,
        ``quantization``) set where the models load when no ``inspector`` is given; see
        :func:`agent_tools.placement.make_placement`. ``strict=True`` serves OpenAI strict function calling: the
        tools list is in strict form and a ``null`` for an optional argument means "not given" (its default)."""
        if inspector is not None and placement:
            raise ValueError("give either an inspector or placement options, not both (the inspector has its own)")
        self.inspector = inspector or Inspector(
            policy=ModelPolicy.bundled_only(), placement=make_placement(**placement)
        )
        self.specs = {spec.name: spec for spec in select_tools(tools)}
        self.strict = strict

    def tools(self) -> list[dict[str, Any]]:
        """The ``tools`` list for the provider request, matching what this dispatcher serves."""
        return openai_tools(tools=self.specs, policy=self.inspector.policy, strict=self.strict)

    def dispatch(self, name: str, arguments: str | Mapping[str, Any] | None) -> dict[str, Any]:
        """Run one tool call: the report as a JSON-ready dict, or an error object the model can act on."""
        result = self._run(name, arguments)
        return result if isinstance(result, dict) else result.model_dump(mode="json")

    def tool_message(self, tool_call: Any) -> dict[str, Any]:
        """A provider tool call (an SDK object or a dict with ``id`` and ``function.name/arguments``) -> the
        ``{"role": "tool", ...}`` message carrying the result: the concise text an LLM reads (≤ 2 KB: summary,
        findings by importance, next calls, key numbers), or the error as JSON. The whole report stays available
        from :meth:`dispatch`."""
        call = tool_call if isinstance(tool_call, Mapping) else _as_dict(tool_call)
        function = call["function"]
        result = self._run(function["name"], function.get("arguments"))
        content = json.dumps(result, ensure_ascii=False) if isinstance(result, dict) else concise_text(result)
        return {"role": "tool", "tool_call_id": call["id"], "content": content}

    def _run(self, name: str, arguments: str | Mapping[str, Any] | None) -> Report | dict[str, Any]:
        spec = self.specs.get(name)
        if spec is None:
            message = f"Error [invalid_input]: unknown tool {name!r}; call one of: {', '.join(self.specs)}"
            return {"error": "invalid_input", "message": message, "field": "name"}
        try:
            parsed = parse_arguments(arguments)
            if self.strict:
                parsed = restore_omitted(parsed, agent_input_model(spec, self.inspector.policy))
            return spec(self.inspector, parsed)
        except AttentionToolError as exc:
            return {**exc.to_dict(), "message": error_text(name, exc)}


def parse_arguments(arguments: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A tool call's arguments: a JSON object as text (what providers send) or already decoded."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"arguments are not valid JSON ({exc.msg} at character {exc.pos})") from exc
    if not isinstance(arguments, Mapping):
        raise InvalidInputError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    return dict(arguments)


def _as_dict(tool_call: Any) -> dict[str, Any]:
    if hasattr(tool_call, "model_dump"):
        return tool_call.model_dump()
    function = tool_call.function
    return {"id": tool_call.id, "function": {"name": function.name, "arguments": function.arguments}}
