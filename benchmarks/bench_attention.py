"""Side-by-side cost of looking at attention, on the default model (issue: performance).

Configurations, each in a fresh process, median of N runs after one warm-up, peak resident memory:
  sdpa       the plain forward with transformers' default attention (the floor)
  sdpa_base  the same without the language-model head (the floor for passes that need no logits)
  eager      eager attention with output_attentions=True (what most inspection tools rely on)
  stats      our capture computing every head's statistics (entropy, max weight, sink share, role scores)
  analyze    the full ``attention-explainer analyze`` pipeline (no files written)
  peer       a peer library on the same task (``--peer-python``: benchmarks/peer_transformer_lens.py in its venv)

    python benchmarks/bench_attention.py --lengths 128,512,2048,8192 --repeats 5 --out benchmarks/results.md
    python benchmarks/bench_attention.py --tools --out benchmarks/results-tools.md   # warm tool calls, cache load

Writes a Markdown table (wall time, ratio to sdpa, peak RSS, RSS above sdpa). Timing targets live here, never
in the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONFIGS = ("sdpa", "sdpa_base", "eager", "stats", "analyze")
TOOL_CALLS = (  # (tool, extra arguments) timed warm on a ~60-token text
    ("describe_model", {}),
    ("show_attention", {"layer": 3, "head": 0}),
    ("diagnose_collapse", {}),
    ("profile_heads", {}),
)
TOOL_TEXT = (
    "When Mary and John went to the store, John gave a drink to Mary. The store was closed on Sunday, so they "
    "walked back home along the river, talked about the weather and planned a picnic for the next warm day, "
    "with bread, cheese and apples from the market near the old bridge."
)
WORDS = (  # noqa: SIM905 - one readable block of words
    "the of and to in is was that for it with as his on be at by had are but from or have an they which "
    "one you were her all she there would their we him been has when who will more no if out so said "
    "what up its about into than them can only other new some could time these two may then do first any "
    "my now such like our over man me even most made after also did many before must through back years "
    "where much your way well down should because each just those people how too little state good very "
    "make world still own see men work long get here "
).split()


def make_text(tokenizer, length: int, seed: int = 0) -> str:
    """Random English words whose tokenisation is at least ``length`` tokens (cut to exactly that later)."""
    import random

    rng = random.Random(seed)
    words: list[str] = []
    while len(tokenizer(" ".join(words))["input_ids"]) < length:
        words.extend(rng.choice(WORDS) for _ in range(max(16, (length - len(words)) // 2)))
    return " ".join(words)


def warm_times(call, repeats: int, *, warm_up: bool = True) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``call``, after one untimed warm-up call (unless ``warm_up`` is off)."""
    if warm_up:
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(config: str, length: int, repeats: int, model_ref: str) -> dict:
    import torch

    from agent_tools.capture import attention_implementation
    from agent_tools.inspector import Inspector
    from agent_tools.loading import load_model
    from agent_tools.runtime import tune_allocator

    tune_allocator()  # as the CLI and the MCP server do; applied to every configuration alike
    torch.manual_seed(0)
    inspector = Inspector()
    loaded = load_model(model_ref)
    text = make_text(loaded.tokenizer, length)
    encoded = inspector.encode(loaded, text)
    ids = encoded.input_ids[:, :length]
    text = loaded.tokenizer.decode(ids[0])
    baseline = peak_rss_mb()

    if config == "sdpa":

        def once() -> None:
            with torch.inference_mode():
                loaded.model(input_ids=ids)

    elif config == "sdpa_base":
        base = loaded.model.base_model

        def once() -> None:
            with torch.inference_mode():
                base(input_ids=ids)

    elif config == "eager":

        def once() -> None:
            with attention_implementation(loaded.model, "eager"), torch.inference_mode():
                out = loaded.model(input_ids=ids, output_attentions=True)
            assert len(out.attentions) == loaded.facts.num_layers

    elif config == "stats":
        from dataclasses import replace

        from agent_tools.consumers.grid import QuantisedMaps

        stats_encoded = replace(
            encoded, input_ids=ids, attention_mask=torch.ones_like(ids), tokens=encoded.tokens[:length]
        )
        role_consumer = _role_consumer(loaded, stats_encoded)

        def once() -> None:
            stats = QuantisedMaps(
                loaded.facts.num_layers, loaded.facts.num_heads, stats_encoded.length, keep_maps=False
            )
            consumers = [stats, role_consumer()]
            inspector.run(loaded, stats_encoded, consumers, need_output=False)

    elif config == "analyze":
        from agent_tools.report.job import run_analysis

        def once() -> None:
            run_analysis(inspector, text, model=model_ref)

    else:
        raise SystemExit(f"unknown config {config}")

    times = warm_times(once, repeats)
    return {
        "config": config,
        "length": int(ids.shape[1]),
        "median_s": statistics.median(times),
        "times_s": times,
        "peak_rss_mb": peak_rss_mb(),
        "after_load_rss_mb": baseline,
    }


def tool_child(repeats: int, model_ref: str) -> dict:
    """Warm tool calls on a ~60-token text (median of ``repeats`` after a warm-up), in one process."""
    from agent_tools.inspector import Inspector
    from agent_tools.loading import load_model
    from agent_tools.runtime import tune_allocator
    from agent_tools.tools import TOOLS

    tune_allocator()
    inspector = Inspector()
    loaded = load_model(model_ref)
    tokens = inspector.encode(loaded, TOOL_TEXT).length
    rows = []
    for name, extra in TOOL_CALLS:
        arguments = {"text": TOOL_TEXT, "model": model_ref} | extra
        if name == "describe_model":
            arguments = {"model": model_ref}
        TOOLS[name](inspector, arguments)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            TOOLS[name](inspector, arguments)
            times.append(time.perf_counter() - start)
        rows.append({"tool": name, "median_s": statistics.median(times), "times_s": times})
    return {"tokens": tokens, "rows": rows, "heads": loaded.facts.num_layers * loaded.facts.num_heads}


def load_child(model_ref: str) -> dict:
    """One cold-process load from the conversion cache (the cache must exist: run any tool once before)."""
    start = time.perf_counter()
    from agent_tools.loading import load_model

    imported = time.perf_counter()
    load_model(model_ref)
    done = time.perf_counter()
    return {"import_s": imported - start, "load_s": done - imported}


def run_tools(args: argparse.Namespace) -> int:
    def child(*extra: str) -> dict:
        command = [sys.executable, __file__, *extra, "--repeats", str(args.repeats), "--model", args.model]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    child("--load-child")  # makes sure the conversion cache exists
    loads = [child("--load-child") for _ in range(args.repeats)]
    tools = child("--tool-child")
    lines = [
        f"# Warm tool calls and loading — {args.model}, {os.cpu_count()} CPU cores",
        "",
        f"Tool calls: median of {args.repeats} after a warm-up, one process, on a {tools['tokens']}-token text "
        f"(profile_heads scores all {tools['heads']} heads). Load: a fresh process each time, from the "
        "conversion cache (imports timed apart).",
        "",
        "| what | median (s) | runs (s) |",
        "|---|---:|---|",
    ]
    for row in tools["rows"]:
        runs = ", ".join(f"{t:.3f}" for t in row["times_s"])
        lines.append(f"| {row['tool']} (warm) | {row['median_s']:.3f} | {runs} |")
    load_times = [x["load_s"] for x in loads]
    import_times = [x["import_s"] for x in loads]
    lines.append(
        f"| load from cache | {statistics.median(load_times):.3f} | {', '.join(f'{t:.3f}' for t in load_times)} |"
    )
    lines.append(
        f"| import agent_tools.loading | {statistics.median(import_times):.3f} | "
        f"{', '.join(f'{t:.3f}' for t in import_times)} |"
    )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(Path(args.out).read_text())
    return 0


def _role_consumer(loaded, encoded):
    """profile_heads' streaming role scorer for the roles measurable on the text itself."""
    from agent_tools.analysis.heads import HEAD_ROLES, PROBE_ROLES, SequenceLayout
    from agent_tools.consumers.roles import RoleScoreConsumer

    layout = SequenceLayout.for_text(
        [t.text for t in encoded.tokens], [t.special for t in encoded.tokens], causal=loaded.facts.is_causal
    )
    roles = [r for r in HEAD_ROLES if r not in PROBE_ROLES and layout.measurable(r)]
    return lambda: RoleScoreConsumer(layout, roles, loaded.facts.num_heads)


def eager_maps_gb(length: int, layers: int = 30, heads: int = 9) -> float:
    return layers * heads * length * length * 4 / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,512,2048,8192")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-eager-gb", type=float, default=12.0, help="skip eager where its maps exceed this")
    parser.add_argument("--out", default="benchmarks/results.md")
    parser.add_argument("--tools", action="store_true", help="time warm tool calls and loading instead")
    parser.add_argument("--peer-python", help="python of a venv with a peer library (benchmarks/peer_*.py)")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--tool-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--load-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.repeats, args.model)))
        return 0
    if args.tool_child:
        print(json.dumps(tool_child(args.repeats, args.model)))
        return 0
    if args.load_child:
        print(json.dumps(load_child(args.model)))
        return 0
    if args.tools:
        return run_tools(args)
    configs = args.configs.split(",")
    if args.peer_python and "peer" not in configs:
        configs.append("peer")
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for config in configs:
            if config in ("eager", "peer") and eager_maps_gb(length) > args.max_eager_gb:
                rows.append(
                    {"config": config, "length": length, "skipped": f"all maps would be {eager_maps_gb(length):.0f} GB"}
                )
                print(f"{config:8s} {length:5d}  skipped", file=sys.stderr)
                continue
            command = [
                sys.executable,
                __file__,
                "--child",
                config,
                str(length),
                "--repeats",
                str(args.repeats),
                "--model",
                args.model,
            ]
            if config == "peer":
                if not args.peer_python:
                    continue
                peer = Path(__file__).with_name("peer_transformer_lens.py")
                command = [args.peer_python, str(peer), "--length", str(length), "--repeats", str(args.repeats)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                rows.append({"config": config, "length": length, "skipped": f"failed: {done.stderr.strip()[-200:]}"})
                print(f"{config:8s} {length:5d}  FAILED\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{config:8s} {length:5d}  {row['median_s']:.3f}s  peak {row['peak_rss_mb']:.0f} MB", file=sys.stderr)
    Path(args.out).write_text(to_markdown(rows, args))
    print(Path(args.out).read_text())
    return 0


def to_markdown(rows: list[dict], args: argparse.Namespace) -> str:
    floor = {r["length"]: r for r in rows if r["config"] == "sdpa" and "median_s" in r}
    base_floor = {r["length"]: r for r in rows if r["config"] == "sdpa_base" and "median_s" in r}
    lines = [
        f"# Attention inspection cost — {args.model}, batch 1, fp32, {os.cpu_count()} CPU cores",
        "",
        f"Median of {args.repeats} runs after a warm-up, each configuration in a fresh process. "
        "`peak RSS` is the process's maximum resident memory (model included); `above sdpa` subtracts the "
        "sdpa run's peak at the same length. `× base` compares with the forward without the language-model head "
        "(sdpa_base), the floor for passes that need no logits (stats stops after the last layer).",
        "",
        "| tokens | configuration | median wall (s) | × sdpa | × base | peak RSS (MB) | above sdpa (MB) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "median_s" not in row:
            lines.append(f"| {row['length']} | {row['config']} | — | — | — | — | {row['skipped']} |")
            continue
        top, base = floor.get(row["length"]), base_floor.get(row["length"])
        ratio = f"{row['median_s'] / top['median_s']:.2f}" if top else "—"
        base_ratio = f"{row['median_s'] / base['median_s']:.2f}" if base else "—"
        above = f"{row['peak_rss_mb'] - top['peak_rss_mb']:+.0f}" if top else "—"
        median, peak = f"{row['median_s']:.3f}", f"{row['peak_rss_mb']:.0f}"
        name = row["config"] + (f" ({row['version']})" if row.get("version") else "")
        lines.append(f"| {row['length']} | {name} | {median} | {ratio} | {base_ratio} | {peak} | {above} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
