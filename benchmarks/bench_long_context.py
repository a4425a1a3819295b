"""Cost and agreement of the long-context tools on the default model (issue 27). Not a test: numbers to read.

  plan       plan_kv_cache on N tokens of prose (docs/ARCHITECTURE.md): seconds, as a multiple of one plain forward
             (the same pass with nothing restricted, its losses included); masked passes; and, for several loss budgets,
             the plan's predicted vs verified loss change (one verifying pass per budget)
  retrieval  find_retrieval_heads over D depths x the given lengths: seconds

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_long_context.py plan --tokens 1024
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_long_context.py plan --tokens 8192 --sink 4 --window 256
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_long_context.py retrieval --lengths 1024 2048

Memory stays within the inspector's budget: the rows of one masked pass are chosen from it (see
agent_tools/long_context.py), so at 8,192 tokens a pass carries fewer rows and there are more passes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent


def prose(tokenizer, tokens: int) -> str:
    """The project's own architecture page, repeated as needed and cut to ``tokens`` tokens."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = (ids * (1 + tokens // max(1, len(ids))))[:tokens]
    return tokenizer.decode(ids)


def bench_plan(args: argparse.Namespace) -> None:
    import resource

    from agent_tools.analysis.long_context import greedy_plan, verified_greedy
    from agent_tools.inspector import Inspector
    from agent_tools.long_context import all_restricted_losses, short_cache_losses
    from agent_tools.runner.short_cache import restricted_pass
    from agent_tools.tools.plan_kv_cache.plan import MIN_TOLERANCE, max_runs

    inspector = Inspector()
    loaded = inspector.model(None)
    facts = loaded.facts
    encoded = inspector.encode(loaded, prose(loaded.tokenizer, args.tokens))
    ids = encoded.input_ids
    first = args.sink + args.window
    restricted_pass(loaded, ids, {}, rows=1, sink=args.sink, window=args.window, scored_from=first)  # warm-up
    start = time.perf_counter()
    restricted_pass(loaded, ids, {}, rows=1, sink=args.sink, window=args.window, scored_from=first)
    plain = time.perf_counter() - start
    groups = facts.num_heads // facts.num_kv_heads
    layers = args.layers if args.layers is not None else list(range(facts.num_layers))
    kv_heads = range(facts.num_kv_heads)
    units = [(layer, tuple(range(kv * groups, (kv + 1) * groups))) for layer in layers for kv in kv_heads]
    start = time.perf_counter()
    measured = short_cache_losses(inspector, loaded, ids, units, sink=args.sink, window=args.window)
    masked = time.perf_counter() - start
    changes = (measured.rows - measured.clean_rows).double().mean(-1).tolist()
    # the floor of an exact per-head measurement: a unit's row runs from its own layer to the last (rows join there)
    floor = sum(facts.num_layers - layer for layer, _ in units) / facts.num_layers
    print(f"tokens {encoded.length}, sink {args.sink}, window {args.window}, {len(units)} KV heads, layers {layers}")
    print(f"plain forward (losses included) {plain:.2f} s")
    print(
        f"every KV head restricted on its own: {masked:.2f} s = {masked / plain:.1f}x plain in {measured.passes} "
        f"masked passes (row-layers run / layers = {floor:.1f} forwards' worth of blocks + {len(units)} output heads)"
    )

    def verify(picked):
        losses, top = all_restricted_losses(
            loaded, ids, [units[i] for i in sorted(picked)], sink=args.sink, window=args.window, clean_row=False
        )
        change = float((losses[0] - measured.clean).double().mean())
        return change, float((top[0] == measured.clean_top).double().mean())

    print(
        "| budget (nats) | tolerance | additive plan: heads, Σ own, verified | verified plan: heads | predicted | "
        "verified | gap | runs | seconds (x plain) | top-token agreement |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for budget in args.budgets:
        additive = greedy_plan(changes, budget)
        tolerance = max(budget / 2, MIN_TOLERANCE)
        start = time.perf_counter()
        built = verified_greedy(changes, budget, tolerance, verify, max_runs=max_runs(len(units)))
        seconds = time.perf_counter() - start
        first_run = built.steps[0].verified if built.steps else 0.0
        gap = abs(built.verified - built.predicted)
        print(
            f"| {budget:g} | {tolerance:g} | {len(additive.chosen)}, {additive.predicted:+.4f}, {first_run:+.4f} | "
            f"{len(built.chosen)} | {built.predicted:+.4f} | {built.verified:+.4f} | {gap:.4f} | {len(built.steps)} | "
            f"{seconds:.1f} ({seconds / plain:.1f}x) | {built.agreement:.3f} |"
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak resident memory of the process: {peak:.0f} MiB")


def bench_retrieval(args: argparse.Namespace) -> None:
    from agent_tools.inspector import Inspector
    from agent_tools.tools import get_tool

    inspector = Inspector()
    arguments = {"lengths": args.lengths, "depths": args.depths, "random_draws": args.draws, "detail": "full"}
    start = time.perf_counter()
    report = get_tool("find_retrieval_heads")(inspector, arguments)
    seconds = time.perf_counter() - start
    print(f"find_retrieval_heads: {len(args.depths)} depths x lengths {args.lengths}: {seconds:.1f} s")
    print(report.summary)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    plan = sub.add_parser("plan")
    plan.add_argument("--tokens", type=int, default=1024)
    plan.add_argument("--sink", type=int, default=4)
    plan.add_argument("--window", type=int, default=64)
    plan.add_argument("--budgets", type=float, nargs="*", default=[0.005, 0.02, 0.05])
    plan.add_argument("--layers", type=int, nargs="+", default=None, help="layers measured (default: all)")
    retrieval = sub.add_parser("retrieval")
    retrieval.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    retrieval.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    retrieval.add_argument("--draws", type=int, default=3)
    args = parser.parse_args(argv)
    {"plan": bench_plan, "retrieval": bench_retrieval}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
