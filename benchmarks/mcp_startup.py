"""How soon the MCP server answers after it starts (stdio, as a client starts it), and how soon a first call returns.

Starts ``python -m agent_tools.cli mcp`` and, at once (before it could have loaded anything), writes
``initialize``, ``notifications/initialized``, ``tools/list`` and a ``tools/call`` of ``show_attention``'s example
with a progress token, then times each answer from the moment the process was started:

  initialize    start -> the initialize result (issue 28's target: under 1 s; the stdio front answers it)
  tools/list    start -> the tools/list result
  first result  start -> the first call's result (it waits for the SDK, torch, the tools and the model)
  progress      notifications/progress received while the first call waited or ran

Then the CPU time (user + system, which the load does not inflate) of short sessions: a client that sends
``initialize``, ``notifications/initialized`` and ``tools/list`` and closes stdin (the front answers both and the
process ends without importing the MCP SDK), beside ``python -c pass`` and an SDK import for scale.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/mcp_startup.py             # one start, Markdown tables
    OMP_WAIT_POLICY=PASSIVE python benchmarks/mcp_startup.py --runs 3    # the median of three starts
    OMP_WAIT_POLICY=PASSIVE python benchmarks/mcp_startup.py --no-call   # the short sessions only (seconds)

A machine under load (other processes on few cores) makes every wall-clock number larger: say the load with them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
SDK_IMPORT = "import mcp.server.lowlevel"
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


def one_start(timeout: float, *, call: bool = True) -> dict[str, float]:
    """Seconds from the process start to each answer, and the progress notifications received. Without ``call``:
    the handshake and ``tools/list`` only, stdin closed at once, and the process's CPU seconds once it ends."""
    sent = messages() if call else messages()[:3]
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "agent_tools.cli", "--artifacts", folder, "mcp"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        process = subprocess.Popen(
            command, env=ENV, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(b"".join((json.dumps(message) + "\n").encode() for message in sent))
        process.stdin.flush()
        if not call:
            process.stdin.close()
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
                if "first result" in times:
                    break
        finally:
            timer.cancel()
            if call:
                process.stdin.close()
                process.terminate()
            process.wait(timeout=30)
        if not call:
            after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the child's own: one child at a time
            times["cpu"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            times["end"] = time.perf_counter() - started
    return times


def cpu_seconds(command: list[str]) -> float:
    """CPU seconds (user + system) of ``command`` run to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _median(runs: list[dict[str, float]], name: str) -> str:
    values = [r[name] for r in runs if name in r]
    return f"{statistics.median(values):.2f}" if values else "no answer"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="starts with a first call (median)")
    parser.add_argument("--short-runs", type=int, default=5, help="short sessions of each kind (median)")
    parser.add_argument("--no-call", action="store_true", help="skip the starts with a first call (minutes)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take in all")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"MCP stdio start-up, load average {load:.1f} on {os.cpu_count()} CPUs at the start (medians)\n")
    if not args.no_call:
        runs = [one_start(args.timeout) for _ in range(args.runs)]
        print(f"{args.runs} start(s) with a first call (`show_attention`'s example, the default model preloading):\n")
        print("| from start to | seconds |\n|---|---:|")
        for name in ("initialize", "tools/list", "first result"):
            print(f"| {name} | {_median(runs, name)} |")
        print(f"| progress notifications before the first result | {_median(runs, 'progress')} |\n")
    short = [one_start(args.timeout, call=False) for _ in range(args.short_runs)]
    print(f"{args.short_runs} short session(s): `initialize` and `tools/list`, then stdin closed:\n")
    print("| from start to | seconds |\n|---|---:|")
    for name in ("initialize", "tools/list"):
        print(f"| {name} | {_median(short, name)} |")
    print(f"| the process's end | {_median(short, 'end')} |\n")
    print("CPU time (user + sys), which the load does not inflate:\n")
    print("| process | CPU s |\n|---|---:|")
    print(f"| `mcp`, the short session above | {_median(short, 'cpu')} |")
    for label, command in (("`python -c pass`", "pass"), ("`python -c 'import mcp.server.lowlevel'`", SDK_IMPORT)):
        seconds = statistics.median(cpu_seconds([sys.executable, "-c", command]) for _ in range(args.short_runs))
        print(f"| {label} | {seconds:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
