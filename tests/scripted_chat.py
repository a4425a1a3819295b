"""A scripted chat model for offline agent tests: its next message is decided by a policy that reads the
conversation so far — in particular the tool messages it received (content, status, artifact).

It behaves like a tool-calling chat model inside ``langchain.agents.create_agent``: ``bind_tools`` converts
the tools to OpenAI-style schemas (so a tool whose schema cannot be converted fails here as it would with a
real provider) and records them; ``_generate`` asks the policy for the next ``AIMessage``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field

Policy = Callable[[list[BaseMessage], list[dict[str, Any]]], AIMessage]
_ids = itertools.count()


class ScriptedChatModel(BaseChatModel):
    """``policy(messages, bound_tool_schemas) -> AIMessage`` decides each turn; every turn is recorded."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    policy: Policy
    bound_tools: list[dict[str, Any]] = Field(default_factory=list)
    turns: list[list[BaseMessage]] = Field(default_factory=list)
    bindings: list[list[dict[str, Any]]] = Field(default_factory=list)  # every bind_tools call, shared by copies

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, **kwargs: Any) -> ScriptedChatModel:
        schemas = [convert_to_openai_tool(tool) for tool in tools]
        self.bindings.append(schemas)
        return self.model_copy(update={"bound_tools": schemas})  # shares `turns` and `bindings` with the original

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kwargs: Any):
        self.turns.append(list(messages))
        message = self.policy(list(messages), self.bound_tools)
        return ChatResult(generations=[ChatGeneration(message=message)])


def call(name: str, **args: Any) -> dict[str, Any]:
    """A tool call as a model emits it."""
    return {"name": name, "args": args, "id": f"call_{next(_ids)}", "type": "tool_call"}


def ask(*calls: dict[str, Any]) -> AIMessage:
    return AIMessage(content="", tool_calls=list(calls))


def answer(text: str) -> AIMessage:
    return AIMessage(content=text)


def new_tool_messages(messages: list[BaseMessage]) -> list[ToolMessage]:
    """The tool messages that answer the model's last turn (what it must read now)."""
    last_ai = max((i for i, m in enumerate(messages) if isinstance(m, AIMessage)), default=-1)
    return [m for m in messages[last_ai + 1 :] if isinstance(m, ToolMessage)]


def all_tool_messages(messages: list[BaseMessage]) -> list[ToolMessage]:
    return [m for m in messages if isinstance(m, ToolMessage)]


def text_of(message: ToolMessage) -> str:
    """The text of a tool message, whether its content is a string or a list of content blocks (MCP adapters)."""
    if isinstance(message.content, str):
        return message.content
    parts = [b.get("text", "") if isinstance(b, dict) else str(b) for b in message.content]
    return "\n".join(parts)


def key_numbers(text: str) -> dict[str, str]:
    """Parse the ``Key numbers: a=1, b=2`` line of a tool's concise text, as an LLM would read it."""
    match = re.search(r"^Key numbers: (.*)$", text, re.MULTILINE)
    if not match:
        return {}
    return dict(re.findall(r"(\w+)=([^,\[\]]+|\[[^\]]*\])(?:, |$)", match.group(1)))


def valid_range(text: str, name: str) -> tuple[int, int] | None:
    """Read ``<name> ... out of range LO..HI`` from an error message."""
    match = re.search(rf"{name} -?\d+ out of range (\d+)\.\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None
