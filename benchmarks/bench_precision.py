"""float32 vs bfloat16 on the CPU: what the stats pass and ``analyze`` cost over the sdpa floor, per precision.

On the default model (``load_model()``, SmolLM2-135M) loaded with ``Placement(dtype="float32")`` and
``Placement(dtype="bfloat16")`` (the GGUF is converted once per dtype into the cache), each configuration in a
fresh process (``OMP_WAIT_POLICY=PASSIVE``), median of N rounds (each: load, warm-up, one timed run):

  sdpa     the plain forward with the language-model head, transformers' sdpa attention (the floor)
  stats    our capture computing every head's statistics: ``Inspector.run(..., need_output=False)`` with the
           grid consumer ``QuantisedMaps(L, H, T, keep_maps=False)`` and profile_heads' role scorer, exactly
           bench_attention.py's ``stats``
  analyze  the full ``attention-explainer analyze`` job (``agent_tools.report.job.run_analysis``, no files)

    python benchmarks/bench_precision.py --lengths 512,2048 --repeats 3 --out benchmarks/results-precision.md

Target: the stats pass at most 1.5× the sdpa floor of the same dtype. Texts and the role consumer come from
bench_attention.py.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import _role_consumer, make_text, peak_rss_mb, warm_times

CONFIGS = ("sdpa", "stats", "analyze")
DTYPES = ("float32", "bfloat16")
TARGET = 1.5  # stats / sdpa of the same dtype


def child(config: str, dtype: str, length: int, repeats: int, model_ref: str | None) -> dict:
    """One configuration in this (fresh) process: warm-up, then ``repeats`` timed runs."""
    from dataclasses import replace

    import torch

    from agent_tools.capture import attention_implementation
    from agent_tools.inspector import Inspector
    from agent_tools.loading import load_model
    from agent_tools.placement import Placement
    from agent_tools.runtime import tune_allocator

    tune_allocator()  # as the CLI and the MCP server do; applied to every configuration alike
    torch.manual_seed(0)
    placement = Placement(dtype=dtype)  # type: ignore[arg-type]
    inspector = Inspector(placement=placement)
    start = time.perf_counter()
    loaded = load_model(model_ref, placement)
    load_s = time.perf_counter() - start
    assert loaded.dtype == getattr(torch, dtype), (loaded.dtype, dtype)
    text = make_text(loaded.tokenizer, length)
    encoded = inspector.encode(loaded, text)
    ids = encoded.input_ids[:, :length]
    encoded = replace(encoded, input_ids=ids, attention_mask=torch.ones_like(ids), tokens=encoded.tokens[:length])
    text = loaded.tokenizer.decode(ids[0])
    baseline = peak_rss_mb()
    notes: list[str] = []

    if config == "sdpa":

        def once() -> None:
            with attention_implementation(loaded.model, "sdpa"), torch.inference_mode():
                loaded.model(input_ids=ids)

    elif config == "stats":
        from agent_tools.consumers.grid import QuantisedMaps

        role_consumer = _role_consumer(loaded, encoded)

        def once() -> None:
            grid = QuantisedMaps(loaded.facts.num_layers, loaded.facts.num_heads, encoded.length, keep_maps=False)
            inspector.run(loaded, encoded, [grid, role_consumer()], need_output=False)
            assert torch.isfinite(grid.entropy).all()

    elif config == "analyze":
        from agent_tools.report.job import run_analysis

        def once() -> None:
            result = run_analysis(inspector, text, model=model_ref)
            for step, why in result.skipped.items():
                note = f"{step} skipped: {why}"
                if note not in notes:
                    notes.append(note)

    else:
        raise SystemExit(f"unknown config {config}")

    times = warm_times(once, repeats)
    return {
        "config": config,
        "dtype": dtype,
        "length": int(ids.shape[1]),
        "median_s": statistics.median(times),
        "times_s": times,
        "load_s": load_s,
        "peak_rss_mb": peak_rss_mb(),
        "after_load_rss_mb": baseline,
        "notes": notes,
    }


def run_parent(args: argparse.Namespace) -> list[dict]:
    """``repeats`` rounds over every configuration, each run a fresh process (warm-up + one timed run).

    Round-robin rather than N runs in a row: on a shared machine a burst of someone else's work then slows one
    run of every configuration instead of every run of one, so the medians (and the ratios) stay comparable.
    """
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    plan = [
        (length, dtype, config)
        for length in [int(x) for x in args.lengths.split(",")]
        for dtype in args.dtypes.split(",")
        for config in args.configs.split(",")
    ]
    runs: dict[tuple[int, str, str], list[dict]] = {key: [] for key in plan}
    failed: dict[tuple[int, str, str], str] = {}  # the last failure of each configuration (later rounds still try)
    loads: list[float] = []
    for round_index in range(args.repeats):
        for key in plan:
            length, dtype, config = key
            command = [sys.executable, __file__, "--child", config, dtype, str(length), "--repeats", "1"]
            command += ["--model", args.model] if args.model else []
            loads.append(os.getloadavg()[0])
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            loads.append(os.getloadavg()[0])
            if done.returncode != 0:
                failed[key] = "failed: " + (done.stderr.strip().splitlines() or ["no output"])[-1][-200:]
                print(f"{config:8s} {dtype:9s} {length:5d}  FAILED\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            runs[key].append(row)
            print(
                f"round {round_index + 1}  {config:8s} {dtype:9s} {length:5d}  {row['median_s']:.3f}s  "
                f"peak {row['peak_rss_mb']:.0f} MB  load {loads[-1]:.2f}",
                file=sys.stderr,
            )
    args.load_range = (min(loads), max(loads)) if loads else None
    rows = []
    for key in plan:
        length, dtype, config = key
        if not runs[key]:
            rows.append({"config": config, "dtype": dtype, "length": length, "skipped": failed.get(key, "no run")})
            continue
        done_runs = runs[key]
        failures = [f"{args.repeats - len(done_runs)} of {args.repeats} rounds {failed[key]}"] if key in failed else []
        times = [r["median_s"] for r in done_runs]
        rows.append(
            {
                "config": config,
                "dtype": dtype,
                "length": done_runs[0]["length"],
                "median_s": statistics.median(times),
                "min_s": min(times),
                "times_s": times,
                "peak_rss_mb": max(r["peak_rss_mb"] for r in done_runs),
                "notes": sorted({n for r in done_runs for n in r["notes"]}) + failures,
            }
        )
    return rows


def to_markdown(rows: list[dict], args: argparse.Namespace, model_name: str) -> str:
    timed = {(r["length"], r["dtype"], r["config"]): r for r in rows if "median_s" in r}
    lines = [
        f"# float32 vs bfloat16 on the CPU — {model_name}, batch 1, {os.cpu_count()} CPU cores",
        "",
        f"Median of {args.repeats} rounds; in each round every configuration runs in a fresh process "
        "(`OMP_WAIT_POLICY=PASSIVE`): load, one warm-up, one timed run. `× sdpa` divides the median by the sdpa "
        "floor's median of the same dtype and length (`min × sdpa`: the same with the fastest runs, less sensitive "
        "to other load on a shared machine); "
        "`× float32` by the same configuration in float32. `stats` = capture + grid statistics + role scores "
        "(no logits, stops after the last layer); `analyze` = the whole job. Target: stats ≤ "
        f"{TARGET}× sdpa of the same dtype.",
        "",
        f"    {args.command}",
        "",
    ]
    if getattr(args, "load_range", None):
        low, high = args.load_range
        lines += [f"1-minute load average around the runs: {low:.2f}–{high:.2f} on {os.cpu_count()} cores.", ""]
    lines += [
        "| tokens | dtype | configuration | median wall (s) | runs (s) | × sdpa | min × sdpa | × float32 "
        "| peak RSS (MB) |",
        "|---:|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        key = (row["length"], row["dtype"], row["config"])
        if "median_s" not in row:
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | — | {row['skipped']} | — | — | — | — |")
            continue
        floor = timed.get((row["length"], row["dtype"], "sdpa"))
        fp32 = timed.get((row["length"], "float32", row["config"]))
        ratio = f"{row['median_s'] / floor['median_s']:.2f}" if floor else "—"
        fastest = f"{row['min_s'] / floor['min_s']:.2f}" if floor and "min_s" in row else "—"
        versus = f"{row['median_s'] / fp32['median_s']:.2f}" if fp32 else "—"
        runs = ", ".join(f"{t:.2f}" for t in row["times_s"])
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {row['median_s']:.3f} | {runs} | {ratio} | {fastest} | {versus} | "
            f"{row['peak_rss_mb']:.0f} |"
        )
    lines += ["", "Stats pass over the sdpa floor, per dtype (target ≤ 1.5×):", ""]
    lines += [
        "| tokens | dtype | stats / sdpa (median) | stats / sdpa (min) | within target |",
        "|---:|---|---:|---:|---|",
    ]
    for length, dtype, config in timed:
        floor = timed.get((length, dtype, "sdpa"))
        if config != "stats" or floor is None:
            continue
        stats = timed[(length, dtype, "stats")]
        ratio = stats["median_s"] / floor["median_s"]
        fastest = stats["min_s"] / floor["min_s"] if "min_s" in stats and "min_s" in floor else ratio
        lines.append(f"| {length} | {dtype} | {ratio:.2f} | {fastest:.2f} | {'yes' if ratio <= TARGET else 'NO'} |")
    notes = sorted({f"{r['dtype']} {r['length']}: {n}" for r in rows for n in r.get("notes", [])})
    if notes:
        lines += ["", "Notes:", "", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="model reference (default: load_model()'s default)")
    parser.add_argument("--out", default="benchmarks/results-precision.md")
    parser.add_argument("--child", nargs=3, metavar=("CONFIG", "DTYPE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        config, dtype, length = args.child
        print(json.dumps(child(config, dtype, int(length), args.repeats, args.model)))
        return 0
    from agent_tools.settings import DEFAULT_MODEL

    args.command = "python benchmarks/bench_precision.py " + " ".join(sys.argv[1:])
    rows = run_parent(args)
    Path(args.out).write_text(to_markdown(rows, args, args.model or DEFAULT_MODEL))
    print(Path(args.out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
