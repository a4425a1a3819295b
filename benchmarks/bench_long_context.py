"""Cost and agreement of the long-context tools on the default model (issue 27). Not a test: numbers to read.

  plan       plan_kv_cache on N tokens of prose (docs/ARCHITECTURE.md): seconds, as a multiple of one plain forward
             (the same pass with nothing restricted, its losses included); masked passes; and, for several loss budgets,
             the plan's predicted vs verified loss change (one verifying pass per budget)
  retrieval  find_retrieval_heads over D depths x the given lengths: seconds, per-pass seconds, peak RSS
  restricted the restricted heads' recomputation in one layer: the short cache's keys only vs every key scored

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


Pass = tuple[dict[int, int], bool, float]  # (layer -> rows joining there, row 0 ran to the end, CPU seconds)


def _timed_passes(layers: int) -> list[Pass]:
    """Time each masked pass of the measurement."""
    from agent_tools.runner import short_cache

    passes: list[Pass] = []
    original = short_cache.restricted_pass

    def timed(loaded, input_ids, restrictions, **kwargs):
        began, cpu = time.perf_counter(), time.process_time()
        result = original(loaded, input_ids, restrictions, **kwargs)
        joining = kwargs.get("joining") or {}
        if joining:
            last, count = max(joining), sum(joining.values())
            whole = not kwargs.get("clean_leaves") or last + 1 >= layers
            passes.append((dict(joining), whole, time.process_time() - cpu))
            print(
                f"  masked pass joining at layers {sorted(joining)}, {count} restricted rows, row 0 "
                f"{'to the end' if whole else f'leaves after layer {last}'}: {time.perf_counter() - began:.1f} s "
                f"wall, {passes[-1][2]:.1f} s CPU; "
                f"peak RSS {_peak_mib():.0f} MiB; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        return result

    short_cache.restricted_pass = timed
    return passes


def _project(passes: list[Pass], plain: float, layers: int, kv_heads: int, rows: int) -> None:
    """The all-layer measurement from the per-pass seconds, as a least-squares cost model: a pass costs
    x per row-layer (row 0's layers + each restricted row's layers from its own) + y per restricted row (its output
    head and restricted attention); a plain forward is ``layers`` row-layers + one output head."""
    import torch

    if len(passes) < 2:
        print("no projection: the cost model needs at least two masked passes (measure two or more layer groups)")
        return
    feature = []
    for joining, whole, _ in passes:
        row0 = layers if whole else max(joining) + 1
        feature.append([row0 + sum(n * (layers - layer) for layer, n in joining.items()), sum(joining.values())])
    a = torch.tensor(feature, dtype=torch.float64)
    b = torch.tensor([p[2] for p in passes], dtype=torch.float64)
    x, y = torch.linalg.lstsq(a, b[:, None]).solution[:, 0].tolist()
    fitted = (a @ torch.tensor([x, y], dtype=torch.float64)).tolist()
    print(
        f"cost model (CPU): {x:.3f} s per row-layer, {y:.2f} s per restricted row (plain forward / layers = "
        f"{plain / layers:.3f} s); fitted vs measured per pass: "
        + ", ".join(f"{f:.0f}/{p[2]:.0f} s" for f, p in zip(fitted, passes, strict=True))
    )
    per = max(1, rows - 1)
    units = [layer for layer in range(layers) for _ in range(kv_heads)]
    total = 0.0
    groups = [units[i : i + per] for i in range(0, len(units), per)]
    for index, group in enumerate(groups):
        last = max(group)
        row0 = layers if index == len(groups) - 1 else last + 1
        total += x * (row0 + sum(layers - layer for layer in group)) + y * len(group)
    print(
        f"projected all-layer measurement ({len(groups)} passes of <= {per} KV heads): {total:.0f} CPU s = "
        f"{total / plain:.1f}x plain"
    )


def bench_plan(args: argparse.Namespace) -> None:
    import resource

    from agent_tools.analysis.long_context import greedy_plan, verified_greedy
    from agent_tools.inspector import Inspector
    from agent_tools.long_context import all_restricted_losses, restricted_rows, short_cache_losses
    from agent_tools.runner.short_cache import restricted_pass
    from agent_tools.tools.plan_kv_cache.plan import MIN_TOLERANCE, max_runs

    inspector = Inspector() if not args.memory_budget else Inspector(memory_budget=int(args.memory_budget * 1024**3))
    loaded = inspector.model(None)
    facts = loaded.facts
    encoded = inspector.encode(loaded, prose(loaded.tokenizer, args.tokens))
    ids = encoded.input_ids
    first = args.sink + args.window
    print(f"load average at start {os.getloadavg()}", flush=True)
    if not args.no_warmup:
        restricted_pass(loaded, ids, {}, rows=1, sink=args.sink, window=args.window, scored_from=first)
    start, cpu = time.perf_counter(), time.process_time()
    restricted_pass(loaded, ids, {}, rows=1, sink=args.sink, window=args.window, scored_from=first)
    plain, plain_cpu = time.perf_counter() - start, time.process_time() - cpu
    plain_peak = _peak_mib()
    print(
        f"plain forward {plain:.1f} s wall, {plain_cpu:.1f} s CPU; peak RSS after it {plain_peak:.0f} MiB; "
        f"load {os.getloadavg()}",
        flush=True,
    )
    passes = _timed_passes(facts.num_layers)
    groups = facts.num_heads // facts.num_kv_heads
    layers = args.layers if args.layers is not None else list(range(facts.num_layers))
    kv_heads = range(facts.num_kv_heads)
    units = [(layer, tuple(range(kv * groups, (kv + 1) * groups))) for layer in layers for kv in kv_heads]
    start, cpu = time.perf_counter(), time.process_time()
    measured = short_cache_losses(inspector, loaded, ids, units, sink=args.sink, window=args.window)
    masked, masked_cpu = time.perf_counter() - start, time.process_time() - cpu
    changes = (measured.rows - measured.clean_rows).double().mean(-1).tolist()
    # the floor of an exact per-head measurement: a unit's row runs from its own layer to the last (rows join there)
    floor = sum(facts.num_layers - layer for layer, _ in units) / facts.num_layers
    print(f"tokens {encoded.length}, sink {args.sink}, window {args.window}, {len(units)} KV heads, layers {layers}")
    print(f"plain forward (losses included) {plain:.2f} s")
    print(
        f"every KV head restricted on its own: {masked:.2f} s = {masked / plain:.1f}x plain in {measured.passes} "
        f"masked passes (row-layers run / layers = {floor:.1f} forwards' worth of blocks + {len(units)} output heads)"
    )
    print(
        f"CPU seconds (one thread: what a shared machine's load does not inflate): plain {plain_cpu:.1f} s, "
        f"masked passes {masked_cpu:.1f} s = {masked_cpu / plain_cpu:.2f}x plain"
    )
    print(f"peak RSS after the masked passes {_peak_mib():.0f} MiB (after the plain forward {plain_peak:.0f} MiB)")
    _project(
        passes, plain_cpu, facts.num_layers, facts.num_kv_heads, restricted_rows(inspector, loaded, encoded.length)
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


def _peak_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _log_passes(inspector, names: tuple[str, ...], start: float) -> None:
    """Print a line after each of the inspector's passes (its seconds, the input length, peak RSS so far, load):
    a run that is stopped early still tells its per-pass cost."""

    def timed(name: str, method):
        def wrapper(loaded, first, *rest, **kwargs):
            began = time.perf_counter()
            result = method(loaded, first, *rest, **kwargs)
            ids = getattr(first, "input_ids", first)
            seconds, since = time.perf_counter() - began, time.perf_counter() - start
            print(
                f"  {name} of {int(ids.shape[-1])} tokens: {seconds:.1f} s (at {since:.0f} s; "
                f"peak RSS {_peak_mib():.0f} MiB; load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
            return result

        return wrapper

    for name in names:
        setattr(inspector, name, timed(name, getattr(inspector, name)))


def bench_retrieval(args: argparse.Namespace) -> None:
    import resource

    from agent_tools.inspector import Inspector
    from agent_tools.tools import get_tool

    budget = int(args.memory_budget * 1024**3) if args.memory_budget else None
    inspector = Inspector() if budget is None else Inspector(memory_budget=budget)
    arguments = {"lengths": args.lengths, "depths": args.depths, "random_draws": args.draws, "detail": "full"}
    print(f"load average at start {os.getloadavg()}, memory budget {inspector.memory_budget / 1024**3:.2f} GiB")
    start = time.perf_counter()
    _log_passes(inspector, ("run", "ablate"), start)
    report = get_tool("find_retrieval_heads")(inspector, arguments)
    seconds = time.perf_counter() - start
    print(f"find_retrieval_heads: {len(args.depths)} depths x lengths {args.lengths}: {seconds:.1f} s")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak resident memory of the process: {peak:.0f} MiB; load average at end {os.getloadavg()}")
    print(report.summary)
    print(report.causal.model_dump_json())


def bench_restricted(args: argparse.Namespace) -> None:
    """The restricted heads' recomputation in one layer (3 query heads of one KV head, SmolLM2's shapes): scoring
    only the sink and each chunk's windows against scoring every key with the others masked (the previous method)."""
    import torch

    from agent_tools.restricted_attention import _CHUNK_FLOATS, _restricted_heads, short_cache_allowed

    generator = torch.Generator().manual_seed(0)
    heads, length, dim, sink, window = 9, args.tokens, 64, args.sink, args.window
    query, key, value = (torch.randn(1, heads, length, dim, generator=generator) for _ in range(3))
    allowed = (torch.arange(length)[None, :] <= torch.arange(length)[:, None])[None]
    pairs = [(0, 0), (0, 1), (0, 2)]

    def every_key() -> torch.Tensor:
        first = sink + window
        rows_b, heads_h = torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2])
        q, k, v = query[rows_b, heads_h, first:], key[rows_b, heads_h], value[rows_b, heads_h]
        chunk, outputs = max(1, _CHUNK_FLOATS // (len(pairs) * length)), []
        for start in range(first, length, chunk):
            stop = min(start + chunk, length)
            positions = torch.arange(start, stop)
            mask = allowed[rows_b, start:stop] & short_cache_allowed(positions, length, sink=sink, window=window)[None]
            scores = torch.matmul(q[:, start - first : stop - first], k.transpose(-1, -2)) * 0.125
            weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
            outputs.append(torch.matmul(weights, v))
        return torch.cat(outputs, dim=1)

    with torch.inference_mode():
        began = time.perf_counter()
        before = every_key()
        every = time.perf_counter() - began
        began = time.perf_counter()
        after, _ = _restricted_heads(query, key, value, allowed, pairs, 0.125, sink=sink, window=window)
        banded = time.perf_counter() - began
    print(
        f"{length} tokens, sink {sink}, window {window}, 3 restricted heads: every key scored {every:.2f} s, "
        f"the short cache's keys only {banded:.2f} s ({every / banded:.1f}x less); max |difference| "
        f"{float((before - after).abs().max()):.2e}; load {os.getloadavg()[0]:.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    plan = sub.add_parser("plan")
    plan.add_argument("--tokens", type=int, default=1024)
    plan.add_argument("--sink", type=int, default=4)
    plan.add_argument("--window", type=int, default=64)
    plan.add_argument("--budgets", type=float, nargs="*", default=[0.005, 0.02, 0.05])
    plan.add_argument("--layers", type=int, nargs="+", default=None, help="layers measured (default: all)")
    plan.add_argument("--memory-budget", type=float, default=None, help="GiB (default: the session's)")
    plan.add_argument("--no-warmup", action="store_true", help="time the first plain forward (long texts)")
    retrieval = sub.add_parser("retrieval")
    retrieval.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    retrieval.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    retrieval.add_argument("--draws", type=int, default=3)
    retrieval.add_argument("--memory-budget", type=float, default=None, help="GiB (default: the session's)")
    restricted = sub.add_parser("restricted")
    restricted.add_argument("--tokens", type=int, default=8192)
    restricted.add_argument("--sink", type=int, default=4)
    restricted.add_argument("--window", type=int, default=256)
    args = parser.parse_args(argv)
    {"plan": bench_plan, "retrieval": bench_retrieval, "restricted": bench_restricted}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
