"""How tests start the MCP server as a subprocess (stdio or HTTP), the way a client would."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def server_command(*options: str, artifacts: Path) -> list[str]:
    """``python -m agent_tools.cli --artifacts DIR mcp OPTIONS...``"""
    return [sys.executable, "-m", "agent_tools.cli", "--artifacts", str(artifacts), "mcp", *options]
