"""How tests start the MCP server as a subprocess (stdio or HTTP), the way a client would, and where the
clients installed by ``scripts/setup.sh`` live (the MCP Inspector CLI; an MCP 1.x client environment)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
TOOLS_DIR = ROOT / ".tools"
INSPECTOR_PREFIX = TOOLS_DIR / "mcp-inspector"  # npm --prefix: @modelcontextprotocol/inspector (scripts/setup.sh)
INSPECTOR = INSPECTOR_PREFIX / "node_modules" / ".bin" / "mcp-inspector"
# A Python with mcp 1.x and langchain-mcp-adapters (which needs mcp<2), everything else from .venv
OLD_CLIENT_PYTHON = TOOLS_DIR / "mcp1-client" / "bin" / "python"


def server_command(*options: str, artifacts: Path) -> list[str]:
    """``python -m agent_tools.cli --artifacts DIR mcp OPTIONS...``"""
    return [sys.executable, "-m", "agent_tools.cli", "--artifacts", str(artifacts), "mcp", *options]


def node_missing() -> str | None:
    """Why the Inspector CLI cannot run here (None when it can)."""
    if shutil.which("node") is None:
        return "node is not installed (the MCP Inspector CLI is a Node.js program)"
    if not INSPECTOR.exists():
        return f"the MCP Inspector CLI is not installed in {INSPECTOR_PREFIX}; run scripts/setup.sh"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def http_server(*options: str, folder: Path, timeout: float = 120) -> Iterator[tuple[str, Path]]:
    """A streamable-HTTP server on a free loopback port: yields its URL and its log file, once it listens."""
    port = free_port()
    command = server_command("--transport", "streamable-http", "--port", str(port), *options, artifacts=folder)
    log_path = folder / f"http-{port}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, env=ENV, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert process.poll() is None, log_path.read_text()
                    assert time.monotonic() < deadline, "the HTTP server did not start"
                    time.sleep(0.2)
            yield f"http://127.0.0.1:{port}/mcp", log_path
        finally:
            process.terminate()
            process.wait(timeout=30)
