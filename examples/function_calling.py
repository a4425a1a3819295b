"""Raw function calling without LangChain: OpenAI-style tool schemas and the dispatcher.

    OPENAI_API_KEY=... python examples/function_calling.py "What does layer 3 head 0 read in 'The cat sat.'?"
    OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=x python examples/function_calling.py --llm my-model

The loop is the usual one: send the messages with ``tools=dispatcher.tools()``; for each tool call the
model makes, append ``dispatcher.tool_message(call)`` (the concise text of the report, ≤ 2 KB, or an error
object naming what is valid); stop when the model answers without tool calls. ``run_conversation`` takes any
``complete`` function, so the same loop works with another provider's SDK (or a scripted model in the tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from agent_tools.prompts import system_prompt
from agent_tools.surfaces.openai import ToolDispatcher

Message = dict[str, Any]
Complete = Callable[[list[Message], list[dict[str, Any]]], Message]  # (messages, tools) -> assistant message


def run_conversation(
    question: str, complete: Complete, *, dispatcher: ToolDispatcher | None = None, max_turns: int = 8
) -> tuple[str, list[Message]]:
    """Ask, execute the tool calls the model makes, repeat; the final answer and the whole conversation."""
    dispatcher = dispatcher or ToolDispatcher()
    tools = dispatcher.tools()
    messages: list[Message] = [
        {"role": "system", "content": system_prompt(tools=dispatcher.specs, policy=dispatcher.inspector.policy)},
        {"role": "user", "content": question},
    ]
    for _ in range(max_turns):
        reply = complete(messages, tools)
        messages.append(reply)
        calls = reply.get("tool_calls") or []
        if not calls:
            return reply.get("content") or "", messages
        messages.extend(dispatcher.tool_message(call) for call in calls)
    raise RuntimeError(f"no final answer after {max_turns} turns")


def openai_complete(model: str) -> Complete:
    """``complete`` with the OpenAI SDK (any OpenAI-compatible endpoint via OPENAI_BASE_URL)."""
    from openai import OpenAI

    client = OpenAI()

    def complete(messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        response = client.chat.completions.create(model=model, messages=messages, tools=tools)  # type: ignore[arg-type]
        return response.choices[0].message.model_dump(exclude_none=True)

    return complete


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What does layer 3 head 0 read in 'The cat sat on the mat.'?")
    parser.add_argument("--llm", default="gpt-4.1-mini", help="the chat model's name at the provider")
    args = parser.parse_args(argv)
    needed = []
    if importlib.util.find_spec("openai") is None:
        needed.append("the package openai (pip install openai)")
    if not os.environ.get("OPENAI_API_KEY"):
        needed.append("the environment variable OPENAI_API_KEY (and OPENAI_BASE_URL for another compatible server)")
    if needed:
        print("To run this example you need: " + "; ".join(needed) + ".", file=sys.stderr)
        return 2
    answer, _ = run_conversation(args.question, openai_complete(args.llm))
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
