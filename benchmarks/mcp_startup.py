"""How soon the MCP server answers after it starts (stdio, as a client starts it), and how soon a first call returns.

Starts ``python -m agent_tools.cli mcp`` and, at once (before it could have loaded anything), writes
``initialize``, ``notifications/initialized``, ``tools/list`` and a ``tools/call`` of ``show_attention``'s example
with a progress token, then times each answer from the moment the process was started:

  initialize    start -> the initialize result (issue 28's target: under 1 s)
  tools/list    start -> the tools/list result
  first result  start -> the first call's result (it waits for the model's background load)
  progress      notifications/progress received while the first call waited or ran

    OMP_WAIT_POLICY=PASSIVE python benchmarks/mcp_startup.py             # one start, a Markdown table
    OMP_WAIT_POLICY=PASSIVE python benchmarks/mcp_startup.py --runs 3    # the median of three starts

A machine under load (other processes on few cores) makes every number larger: say the load with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
EXAMPLE = {"text": "The cat sat on the mat because it was tired.", "layer": 3, "head": 0}


def messages() -> list[dict[str, Any]]:
    initialize = {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "startup-benchmark", "version": "1"},
    }
    call = {"name": "show_attention", "arguments": EXAMPLE, "_meta": {"progressToken": "first"}}
    return [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": initialize},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
        {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": call},
    ]


def one_start(timeout: float) -> dict[str, float]:
    """Seconds from the process start to each answer, and the progress notifications received."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "agent_tools.cli", "--artifacts", folder, "mcp"]
        started = time.perf_counter()
        process = subprocess.Popen(
            command, env=ENV, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        assert process.stdin is not None and process.stdout is not None
        for message in messages():
            process.stdin.write((json.dumps(message) + "\n").encode())
        process.stdin.flush()
        times: dict[str, float] = {"progress": 0}
        names = {1: "initialize", 2: "tools/list", 3: "first result"}
        timer = threading.Timer(timeout, process.kill)
        timer.start()
        try:
            for line in process.stdout:
                reply = json.loads(line)
                if reply.get("method") == "notifications/progress":
                    times["progress"] += 1
                elif reply.get("id") in names:
                    assert "error" not in reply, reply
                    times[names[reply["id"]]] = time.perf_counter() - started
                    if reply["id"] == 2:
                        times["tools/list bytes"] = len(json.dumps(reply["result"], separators=(",", ":")))
                if "first result" in times:
                    break
        finally:
            timer.cancel()
            process.stdin.close()
            process.terminate()
            process.wait(timeout=30)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take in all")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    runs = [one_start(args.timeout) for _ in range(args.runs)]
    print(f"MCP stdio start-up, {args.runs} run(s), load average {load:.1f} on {os.cpu_count()} CPUs (median)\n")
    print("| from start to | seconds |\n|---|---:|")
    for name in ("initialize", "tools/list", "first result"):
        values = [r[name] for r in runs if name in r]
        print(f"| {name} | {statistics.median(values):.2f} |" if values else f"| {name} | no answer |")
    print(f"| progress notifications before the first result | {statistics.median(r['progress'] for r in runs):g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
