"""The MCP server through the official MCP Inspector CLI (npm ``@modelcontextprotocol/inspector``, installed in
``.tools/mcp-inspector`` by ``scripts/setup.sh``), in the ``modern`` (2026-07-28 only, no fallback) and ``auto``
(discover, then fall back) protocol eras, over stdio and streamable HTTP.

    .tools/mcp-inspector/node_modules/.bin/mcp-inspector --cli --protocol-era modern --method tools/list \\
        python -m agent_tools.cli mcp
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from mcp_process import ENV, INSPECTOR, ROOT, http_server, node_missing, server_command

from agent_tools.tools import TOOLS

pytestmark = [pytest.mark.real_model, pytest.mark.skipif(node_missing() is not None, reason=str(node_missing()))]

ERAS = ("modern", "auto")
SERVED = "describe_model,show_attention"


def inspector(*arguments: str, home: Path) -> tuple[dict[str, Any], str]:
    """Run the Inspector CLI once (JSON output); return its result and its stderr."""
    env = {**ENV, "HOME": str(home), "MCP_CATALOG_PATH": str(home / "mcp.json"), "NO_COLOR": "1"}
    done = subprocess.run(
        [str(INSPECTOR), "--cli", "--format", "json", "--connect-timeout", "180000", *arguments],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout)["result"], done.stderr


def stdio_target(folder: Path) -> list[str]:
    return ["--", *server_command("--no-preload", "--tools", SERVED, artifacts=folder)]


@pytest.mark.parametrize("era", ERAS)
def test_stdio_tools_call(era: str, tmp_path: Path) -> None:
    arguments = json.dumps({"model": "minilm-l6"})
    result, stderr = inspector(
        "--protocol-era", era, "--method", "tools/call", "--tool-name", "describe_model",
        "--tool-args-json", arguments, *stdio_target(tmp_path), home=tmp_path,
    )  # fmt: skip
    assert result.get("isError") is not True and result["structuredContent"]["num_layers"] == 6
    assert result["content"][0]["text"].startswith("minilm-l6 is a bert encoder with 6 layers")
    assert "Traceback" not in stderr


def test_http_both_eras(tmp_path: Path) -> None:
    with http_server("--model", "minilm-l6", "--tools", SERVED, folder=tmp_path) as (url, log):
        for era in ERAS:
            # --strict: schema portability problems in full on stderr, and exit 6 on any error-severity one
            listed, stderr = inspector("--protocol-era", era, "--method", "tools/list", "--strict", url, home=tmp_path)
            assert [tool["name"] for tool in listed["tools"]] == SERVED.split(",")
            for tool in listed["tools"]:
                assert tool["outputSchema"]["type"] == "object" and "$ref" not in json.dumps(tool["inputSchema"])
            assert "Path: outputSchema" not in stderr  # not even a portability warning on the output schemas
            example = json.dumps({**TOOLS["show_attention"].example, "model": "minilm-l6", "layer": 5})
            called, _ = inspector(
                "--protocol-era", era, "--method", "tools/call", "--tool-name", "show_attention",
                "--tool-args-json", example, url, home=tmp_path,
            )  # fmt: skip
            assert called.get("isError") is not True and called["structuredContent"]["layer"] == 5
        text = log.read_text()
        assert text.count("loaded minilm-l6") == 1 and "Traceback" not in text
    assert os.environ.get("HOME") != str(tmp_path)
