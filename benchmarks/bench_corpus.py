"""Corpus runs: throughput of the local engine vs Ray Data with an actor pool, and the per-text cost against
calling the single-prompt tools one text at a time (issue: corpus runs).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_corpus.py --texts 200 --tokens 128 \
        --out benchmarks/results-corpus.md

Waits until the 1-minute load average is below ``--max-load`` (re-checking every 60 s, 10 minutes at most; other
jobs on a shared machine would make the numbers meaningless), then, on the default model:

  local        ``run_corpus(task, engine="local")``: one process, torch's default threads
  ray          ``run_corpus(task, engine="ray", actors=N)``: a local Ray, N actors of one CPU thread each
  single       the single-prompt tools on each text, as an agent would call them: profile_heads (text roles,
               no probe) and diagnose_collapse, two forward passes per text

``end-to-end`` includes start-up (a local Ray, the actors, the model loads); ``steady`` excludes it: a short run
of one batch per worker is timed too, and steady = (texts − short run's texts) / (wall − short run's wall).
Timing targets live here, never in the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import make_text  # the benchmarks' shared random-words text

TOKENS_PER_MILLION = 1_000_000
TASK = "profile"  # the single-prompt comparison is profile_heads + diagnose_collapse


def wait_for_quiet(max_load: float, *, every: int = 60, limit: int = 600) -> float:
    """Block until the 1-minute load average is below ``max_load`` (or ``limit`` seconds passed); return it."""
    waited = 0
    load = os.getloadavg()[0]
    while load >= max_load and waited < limit:
        print(f"load average {load:.2f} >= {max_load}; waiting {every} s", file=sys.stderr, flush=True)
        time.sleep(every)
        waited += every
        load = os.getloadavg()[0]
    return load


class LoadSampler:
    """The 1-minute load average every ``every`` seconds while the benchmark runs (a shared machine's noise)."""

    def __init__(self, every: float = 5.0) -> None:
        self.every, self.samples = every, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def text(self) -> str:
        return f"mean {statistics.mean(self.samples):.2f}, max {max(self.samples):.2f} over {len(self.samples)} samples"


def make_corpus(path: Path, count: int, tokens: int) -> list[str]:
    """``count`` random-word texts of exactly ``tokens`` tokens (the default model's tokenizer), as JSONL."""
    from agent_tools.loading import load_model

    tokenizer = load_model(None).tokenizer
    texts = []
    for seed in range(count):
        ids = tokenizer(make_text(tokenizer, tokens, seed=seed), add_special_tokens=False)["input_ids"][:tokens]
        texts.append(tokenizer.decode(ids))
    path.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    return texts


def _wall(data: Path, engine: str, *, actors: int, batch_size: int, out: Path) -> tuple[float, Any]:
    from agent_tools.corpus import run_corpus
    from agent_tools.corpus.ray_engine import RayOptions

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    result = run_corpus(
        TASK, data, out=out, engine=engine, batch_size=batch_size, progress=False, ray_options=RayOptions(actors=actors)
    )
    return time.perf_counter() - start, result.arrow


def timed_corpus(texts: list[str], engine: str, *, actors: int, batch_size: int, scratch: Path) -> dict[str, Any]:
    """The whole run, and a short one (one batch per worker: start-up, model loads, first batch); the steady rate is
    the difference: (texts − short texts) / (whole wall − short wall)."""
    short = batch_size * (actors if engine == "ray" else 1)
    (scratch / "short.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts[:short]) + "\n")
    short_wall, _ = _wall(scratch / "short.jsonl", engine, actors=actors, batch_size=batch_size, out=scratch / "short")
    wall, table = _wall(scratch / "texts.jsonl", engine, actors=actors, batch_size=batch_size, out=scratch / engine)
    return {
        "wall": wall,
        "short_wall": short_wall,
        "end_to_end": len(texts) / wall,
        "steady": (len(texts) - short) / (wall - short_wall),
        "table": table,
    }


def single_prompt_cost(texts: list[str]) -> dict[str, float]:
    """Seconds per text calling profile_heads (text roles) and diagnose_collapse on it, warm model."""
    from agent_tools.analysis.heads import TEXT_ROLES
    from agent_tools.inspector import Inspector
    from agent_tools.tools import get_tool

    inspector = Inspector()
    profile, collapse = get_tool("profile_heads"), get_tool("diagnose_collapse")
    profile(inspector, {"text": texts[0], "roles": list(TEXT_ROLES), "induction_check": False})  # warm-up
    seconds = []
    for text in texts:
        start = time.perf_counter()
        profile(inspector, {"text": text, "roles": list(TEXT_ROLES), "induction_check": False})
        collapse(inspector, {"text": text, "top_k": 2000})
        seconds.append(time.perf_counter() - start)
    return {"per_text": statistics.median(seconds), "texts": len(texts)}


def markdown(
    args: argparse.Namespace, load: float, during: str, runs: dict[str, dict[str, Any]], single: dict[str, float]
) -> str:
    import torch

    corpus_local = 1 / runs["local"]["steady"]
    lines = [
        f"# Corpus runs — smollm2-135m-instruct, {args.texts} texts of {args.tokens} tokens, task {TASK}, "
        f"{os.cpu_count()} CPU cores",
        "",
        f"Load average before the run: {load:.2f}; during it (this benchmark included, 2 cores): {during}. "
        f"Local engine: torch {torch.get_num_threads()} threads; Ray: "
        f"{args.actors} actors × 1 thread. Batch size {args.batch_size}. `OMP_WAIT_POLICY=PASSIVE`.",
        "",
        "    " + " ".join(["python benchmarks/bench_corpus.py", *sys.argv[1:]]),
        "",
        "| engine | end-to-end wall (s) | end-to-end texts/s | start-up + first batch (s) | steady texts/s | "
        "s per text (steady) | tokens/s (steady) | CPU-core-hours per 1M tokens (steady) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, run in runs.items():
        tokens_per_s = run["steady"] * args.tokens
        cpu_hours = TOKENS_PER_MILLION / tokens_per_s * (os.cpu_count() or 1) / 3600
        lines.append(
            f"| {name} | {run['wall']:.1f} | {run['end_to_end']:.2f} | {run['short_wall']:.1f} | {run['steady']:.2f} "
            f"| {1 / run['steady']:.3f} | {tokens_per_s:.0f} | {cpu_hours:.2f} |"
        )
    lines += [
        "",
        f"Single-prompt tools, one text at a time (profile_heads text roles + diagnose_collapse, median of "
        f"{single['texts']} texts, warm): {single['per_text']:.3f} s per text; the local corpus engine "
        f"{corpus_local:.3f} s per text ({single['per_text'] / corpus_local:.2f}× faster: one shared forward pass "
        "instead of two).",
        "",
        f"Tables identical across engines: {runs['local']['table'].equals(runs['ray']['table'])}.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--single", type=int, default=20, help="texts timed with the single-prompt tools")
    parser.add_argument("--max-load", type=float, default=2.0)
    parser.add_argument("--out", default=None, help="write the Markdown table here")
    args = parser.parse_args()
    load = wait_for_quiet(args.max_load)
    if load >= args.max_load:
        print(f"load average still {load:.2f} after 10 minutes; not benchmarking", file=sys.stderr)
        return 1
    scratch = Path(tempfile.mkdtemp(prefix="bench-corpus-"))
    try:
        with LoadSampler() as sampler:
            texts = make_corpus(scratch / "texts.jsonl", args.texts, args.tokens)
            runs = {
                engine: timed_corpus(texts, engine, actors=args.actors, batch_size=args.batch_size, scratch=scratch)
                for engine in ("local", "ray")
            }
            single = single_prompt_cost(texts[: args.single])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    text = markdown(args, load, sampler.text(), runs, single)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
