"""Drive the attention-explainer MCP server with the official MCP Python client, as a desktop assistant would.

    python examples/mcp_client.py                                  # starts the server from mcp_client_config.json
    python examples/mcp_client.py --model minilm-l6 --layer 5 --head 11 --text "The cat sat on the mat."

The server is started exactly as the client configuration (``mcp_client_config.json``) says, over stdio:
list the tools, call ``describe_model`` and ``show_attention``, read the structured content, and show the
error a bad layer gets back.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

CONFIG = Path(__file__).with_name("mcp_client_config.json")
SERVER = "attention-explainer"


def server_parameters(config_path: Path = CONFIG, *, extra_args: Sequence[str] = ()) -> StdioServerParameters:
    """The server entry of an MCP client configuration, as stdio parameters."""
    entry = json.loads(config_path.read_text())["mcpServers"][SERVER]
    command = entry["command"]
    if shutil.which(command) is None:  # not on PATH: the console script next to this Python
        command = str(Path(sys.executable).with_name(command))
    return StdioServerParameters(
        command=command, args=[*entry.get("args", []), *extra_args], env={**os.environ, **entry.get("env", {})}
    )


async def tour(params: StdioServerParameters, *, text: str, layer: int, head: int, model: str | None) -> list[str]:
    """One session: the lines this example prints."""
    lines = []
    chosen = {"model": model} if model else {}
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        init = await session.initialize()
        lines.append(f"connected to {init.server_info.name} {init.server_info.version}")
        tools = (await session.list_tools()).tools
        lines.append("tools: " + ", ".join(tool.name for tool in tools))

        described = await session.call_tool("describe_model", chosen)
        facts: dict[str, Any] = described.structured_content or {}
        lines.append(
            f"describe_model: {facts['num_layers']} layers x {facts['num_heads']} heads, head_dim {facts['head_dim']}"
        )

        shown = await session.call_tool("show_attention", {**chosen, "text": text, "layer": layer, "head": head})
        report: dict[str, Any] = shown.structured_content or {}
        lines.append(f"show_attention: {report['summary']}")
        for row in report["rows"][:4]:
            keys = ", ".join(f"{k['token']!r} {k['weight']:.2f}" for k in row["top_keys"])
            lines.append(f"  query {row['position']} {row['token']!r} reads {keys}")

        bad = await session.call_tool("show_attention", {**chosen, "text": text, "layer": 999, "head": head})
        lines.append(f"error (isError={bad.is_error}): {bad.content[0].text}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG, help="MCP client configuration (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model argument for the calls (default: the server's)")
    parser.add_argument("--text", default="The cat sat on the mat because it was tired.")
    parser.add_argument("--layer", type=int, default=3)
    parser.add_argument("--head", type=int, default=0)
    args = parser.parse_args(argv)
    params = server_parameters(args.config)
    for line in anyio.run(lambda: tour(params, text=args.text, layer=args.layer, head=args.head, model=args.model)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
