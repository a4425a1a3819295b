"""How soon ``attention-explainer call`` answers a usage error (issue 28's target: ≤ 0.5 s, torch never imported).

Each case is a mistake an agent makes: a head written as "18,6", a layer past the model's, a list given as a
string, a choice not allowed, an unknown argument or tool, a text longer than the model reads. Every case runs as
a fresh process (as an agent's shell call does; the checks read the tools' declaration data, nothing is built
first); the wall time of the whole process is measured, and the process says whether torch was imported.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/early_errors.py            # a Markdown table, median of 3 runs
    OMP_WAIT_POLICY=PASSIVE python benchmarks/early_errors.py --runs 5

A machine under load makes every number larger: the table states the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("head as '18,6'", "show_attention", {"text": "hi", "layer": 18, "head": "18,6"}),
    ("layer 99", "show_attention", {"text": "hi", "layer": 99, "head": 0}),
    ("layers as '18'", "diagnose_collapse", {"text": "hi", "layers": "18"}),
    ("detail 'all'", "show_attention", {"text": "hi", "layer": 3, "head": 0, "detail": "all"}),
    ("unknown argument", "show_attention", {"text": "hi", "layr": 3, "head": 0}),
    ("unknown tool", "show_atention", {}),
    ("560,000 characters", "show_attention", {"text": "word " * 112_000, "layer": 3, "head": 0}),
]
PROBE = "import sys, agent_tools.cli as cli\ncode = cli.main(sys.argv[1:])\nprint(code, 'torch' in sys.modules)\n"


def one(tool: str, arguments: dict[str, object]) -> tuple[float, str, str]:
    """(seconds, the process's answer line, the error line) for one call as a fresh process."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "call", tool, "--json", "-"],
        input=json.dumps(arguments),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    return time.perf_counter() - started, done.stdout.strip(), done.stderr.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"usage errors of `call`, fresh process each, median of {args.runs}; load average {load:.1f} on "
          f"{os.cpu_count()} CPUs\n")  # fmt: skip
    print("| mistake | seconds | exit, torch imported | error (first 90 characters) |\n|---|---:|---|---|")
    for label, tool, arguments in CASES:
        runs = [one(tool, arguments) for _ in range(args.runs)]
        seconds = statistics.median(r[0] for r in runs)
        print(f"| {label} | {seconds:.2f} | {runs[0][1]} | {runs[0][2][:90]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
