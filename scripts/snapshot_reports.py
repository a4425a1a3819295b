"""Write every tool's report on its example arguments (and the ``analyze`` document) as JSON, for refactors.

    python scripts/snapshot_reports.py OUT_DIR            # one JSON file per tool + analyze.json
    python scripts/snapshot_reports.py OUT_DIR --compare BEFORE_DIR [--only show_attention,analyze]

A behaviour-preserving change must leave every file identical (``--compare`` lists the ones that differ). Every call
runs in its own call scope, so ``--only`` gives the same files as a full run (a report's path gap is its own text's).
Artifact paths are written relative to the artifact folder so two runs in different folders compare equal.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def _write(out: Path, only: list[str] | None) -> None:
    import torch

    # one thread: in bfloat16 (dtype auto on a CPU with bfloat16 hardware) the matmuls' rounding follows the
    # thread count, and two runs at 1 and 2 threads differed in ablation baselines by 5 %
    torch.set_num_threads(1)
    from agent_tools.inspector import Inspector
    from agent_tools.report.job import run_analysis
    from agent_tools.tools import TOOLS

    with tempfile.TemporaryDirectory() as artifacts:
        inspector = Inspector(artifact_dir=artifacts)
        for name, spec in TOOLS.items():
            if only is not None and name not in only:
                continue
            report = spec(inspector, dict(spec.example))
            text = report.model_dump_json(indent=2).replace(str(Path(artifacts).resolve()), "<artifacts>")
            (out / f"{name}.json").write_text(text, encoding="utf-8")
            print(f"{name}: {len(text):,} characters", file=sys.stderr)
        if only is not None and "analyze" not in only:
            return
        result = run_analysis(Inspector(), None)
        document = json.loads(result.to_report().model_dump_json())
        document.pop("timings", None)  # seconds differ from run to run
        (out / "analyze.json").write_text(json.dumps(document, indent=2), encoding="utf-8")


def _compare(out: Path, before: Path) -> int:
    differ = []
    for path in sorted(before.glob("*.json")):
        after = out / path.name
        if not after.exists():
            continue
        if json.loads(after.read_text()) != json.loads(path.read_text()):
            differ.append(path.name)
    print("identical" if not differ else "differ: " + ", ".join(differ))
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--compare", default=None, help="a folder written by an earlier run")
    parser.add_argument("--only", default=None, help="comma-separated tool names (and/or 'analyze'); default all")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write(out, args.only.split(",") if args.only else None)
    return _compare(out, Path(args.compare)) if args.compare else 0


if __name__ == "__main__":
    raise SystemExit(main())
