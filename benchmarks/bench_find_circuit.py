"""find_circuit on a ~20-token clean/corrupted pair on the default model: wall time of one warm call.

Run: PYTHONPATH=$PWD OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_find_circuit.py
"""

from __future__ import annotations

import os
import time

from agent_tools.inspector import Inspector
from agent_tools.tools import TOOLS

ARGUMENTS = {
    "clean": "When Mary and John went to the store on Monday, John gave a drink to the girl named",
    "corrupted": "When Mary and John went to the store on Monday, Mary gave a drink to the girl named",
    "answer": " Mary",
    "wrong": " John",
    "detail": "full",
}


def main() -> None:
    spec = TOOLS["find_circuit"]
    inspector = Inspector()
    spec(inspector, {**ARGUMENTS, "steps": 1})  # load and warm
    load = os.getloadavg()[0]
    start = time.perf_counter()
    report = spec(inspector, ARGUMENTS)
    elapsed = time.perf_counter() - start
    print(f"find_circuit: {report.tokens} tokens, {report.steps} steps, {report.edges_scored} edges scored")
    print(f"wall {elapsed:.1f} s (1-min load average before: {load:.2f}, {os.cpu_count()} CPUs)")
    print(report.summary)
    print(f"ranking {report.ranking}: {report.circuit_edges} edges, faithfulness {report.faithfulness}")
    print([(p.edges, p.heads, p.faithfulness, p.random_mean) for p in report.curve])


if __name__ == "__main__":
    main()
