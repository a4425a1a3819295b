"""An older MCP client: the 1.x Python SDK with langchain-mcp-adapters (which needs mcp<2), run by
``tests/test_mcp.py`` with ``.tools/mcp1-client/bin/python`` (see ``scripts/setup.sh``).

    .tools/mcp1-client/bin/python tests/mcp_old_client.py SERVER_COMMAND...

Starts the server over stdio, opens a handshake-era session, loads the tools into LangChain agents and runs two
scripted agents (one correct call; one out-of-range layer, then the corrected call); prints one JSON line with
what the client saw.
"""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import version
from typing import Any

import anyio
from langchain.agents import create_agent
from langchain_mcp_adapters.tools import load_mcp_tools
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from scripted_chat import (  # beside this script: its folder is on sys.path
    ScriptedChatModel,
    all_tool_messages,
    answer,
    ask,
    call,
    new_tool_messages,
    text_of,
    valid_range,
)

SHOW = {"text": "The cat sat on the mat because it was tired.", "layer": 3, "head": 0}


async def run(command: list[str]) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    params = StdioServerParameters(command=command[0], args=command[1:], env=env)
    seen: dict[str, Any] = {"sdk": version("mcp")}
    async with stdio_client(params, errlog=sys.stderr) as (read, write), ClientSession(read, write) as session:
        init = await session.initialize()
        seen["protocol"] = init.protocolVersion
        lc_tools = await load_mcp_tools(session)
        seen["tool_names"] = [t.name for t in lc_tools]

        def correct(messages: list[Any], bound: Any) -> Any:
            received = new_tool_messages(messages)
            if not received:
                return ask(call("show_attention", **SHOW))
            message = received[0]
            structured = message.artifact["structured_content"]
            seen["correct"] = {"status": message.status, "text": text_of(message), "structured": structured}
            return answer(f"Layer {structured['layer']}: mean entropy {structured['mean_entropy']} nats.")

        def corrected(messages: list[Any], bound: Any) -> Any:
            received = new_tool_messages(messages)
            if not received:
                return ask(call("show_attention", **{**SHOW, "layer": 99}))
            message = received[0]
            if message.status == "error":
                _, high = valid_range(text_of(message), "layer")
                return ask(call("show_attention", **{**SHOW, "layer": high}))
            return answer(f"Layer {message.artifact['structured_content']['layer']} done.")

        for name, policy in (("correct", correct), ("corrected", corrected)):
            agent = create_agent(ScriptedChatModel(policy=policy), lc_tools)
            result = await agent.ainvoke({"messages": [("user", "What does layer 3 head 0 read?")]})
            seen[f"{name}_final"] = result["messages"][-1].content
            if name == "corrected":
                seen["corrected_messages"] = [
                    {
                        "status": m.status,
                        "text": text_of(m),
                        "layer": ((m.artifact or {}).get("structured_content") or {}).get("layer"),
                    }
                    for m in all_tool_messages(result["messages"])
                ]
    return seen


if __name__ == "__main__":
    print(json.dumps(anyio.run(run, sys.argv[1:]), default=str))
