"""The cost of looking at attention on a CUDA GPU, in bfloat16, and the capture's parity there.

One process, the model loaded once (``Placement(dtype="bfloat16", device="cuda")``), each configuration timed
with ``torch.cuda.synchronize`` (median of N runs after a warm-up) and its peak ``torch.cuda.max_memory_allocated``
(reset before each configuration); an out-of-memory configuration is reported as OOM and the next one runs:

  sdpa     the plain forward with transformers' sdpa attention (the floor)
  flash    the same with ``attn_implementation="flash_attention_2"`` (skipped, with the reason, without flash-attn)
  eager    eager attention with ``output_attentions=True`` (every map of every layer, what most tools rely on)
  stats    our capture computing every head's statistics (grid entropy / max weight / sink share and the
           profile_heads role scores; no logits, stops after the last layer), as bench_attention.py's ``stats``
  analyze  the full ``attention-explainer analyze`` job (``run_analysis``, no files)

plus a parity check: on a short text the captured weights against the model's own eager output_attentions.

    python benchmarks/bench_gpu.py --out benchmarks/results-gpu.md          # ~8 minutes on one H200
    python benchmarks/bench_gpu.py --dry-run   # the same script on the CPU, 64 tokens, to /tmp (checks it runs)

Lengths past the model's trained positions (SmolLM2: 8192) are run anyway — RoPE computes any position, and
only the cost is measured here. Without CUDA this prints one line and exits 0 (``--dry-run`` runs every step on the
CPU in float32 instead, timings and peaks meaningless, so a broken script shows before GPU time is spent on it).
The table is rewritten after every configuration, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for agent_tools
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import make_text  # the same texts as the CPU benchmark

CONFIGS = ("sdpa", "flash", "eager", "stats", "analyze")
LENGTHS = "2048,8192,32768"
SLOW_WARMUP_S = 30.0  # a configuration whose warm-up took longer is timed once, not N times


class KeepWeights:
    """Keeps every layer's captured weights (the parity check's short text only)."""

    accepts_key_prefix = False

    def __init__(self) -> None:
        self.rows: dict[int, list[Any]] = {}

    def on_layer(self, layer: Any) -> None:
        self.rows.setdefault(layer.layer, []).append(layer.weights.clone())


def role_consumer(loaded: Any, encoded: Any) -> Any:
    """profile_heads' streaming role scorer for the roles measurable on the text itself."""
    from agent_tools.analysis.heads import HEAD_ROLES, PROBE_ROLES, SequenceLayout
    from agent_tools.consumers.roles import RoleScoreConsumer

    layout = SequenceLayout.for_text(
        [t.text for t in encoded.tokens], [t.special for t in encoded.tokens], causal=loaded.facts.is_causal
    )
    roles = [r for r in HEAD_ROLES if r not in PROBE_ROLES and layout.measurable(r)]
    return RoleScoreConsumer(layout, roles, loaded.facts.num_heads)


def gib(value: float) -> float:
    return value / 2**30


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from agent_tools.inspector import Inspector
        from agent_tools.loading import load_model
        from agent_tools.placement import Placement
        from agent_tools.settings import DEFAULT_MODEL

        self.torch = torch
        self.args = args
        self.started = time.perf_counter()
        self.lengths = [int(x) for x in args.lengths.split(",")]
        self.cuda = args.device.startswith("cuda")
        self.placement = Placement(dtype="bfloat16" if self.cuda else "float32", device=args.device)
        start = time.perf_counter()
        self.loaded = load_model(args.model, self.placement)
        self.load_s = time.perf_counter() - start
        self.model_name = args.model or DEFAULT_MODEL
        self.notes: list[str] = []
        trained = self.loaded.facts.max_positions
        if trained and max(self.lengths) > trained:
            self.loaded.facts = replace(self.loaded.facts, max_positions=None)  # cost only: see the docstring
            self.notes.append(f"lengths above the model's {trained} trained positions run with RoPE extrapolated")
        self.inspector = Inspector(placement=self.placement, token_limit=max(self.lengths) + 16)
        self.weights_bytes = torch.cuda.memory_allocated() if self.cuda else 0
        self.rows: list[dict[str, Any]] = []
        self.parity: dict[str, Any] = {}
        self.restore: Any = None  # undoes a configuration's change to the model (flash)

    # --- helpers ----------------------------------------------------------------------------------------
    def encoded(self, length: int) -> Any:
        loaded = self.loaded
        encoded = self.inspector.encode(loaded, make_text(loaded.tokenizer, length))
        ids = encoded.input_ids[:, :length]
        return replace(encoded, input_ids=ids, attention_mask=self.torch.ones_like(ids), tokens=encoded.tokens[:length])

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated() if self.cuda else 0

    def total_memory(self) -> int:
        if self.cuda:
            return self.torch.cuda.get_device_properties(self.loaded.device).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def left_s(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.started)

    def timed(self, once: Any) -> dict[str, Any]:
        torch = self.torch
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        self.sync()
        start = time.perf_counter()
        once()  # warm-up
        self.sync()
        warm = time.perf_counter() - start
        # A slow configuration is timed fewer times: once past SLOW_WARMUP_S, and never past the time budget.
        fits = int(max(self.left_s(), 0.0) // max(warm, 1e-9))
        repeats = 1 if warm > SLOW_WARMUP_S else max(1, min(self.args.repeats, fits))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            once()
            self.sync()
            times.append(time.perf_counter() - start)
        return {"median_s": statistics.median(times), "times_s": times, "peak_bytes": self.peak()}

    # --- the configurations -----------------------------------------------------------------------------
    def config(self, name: str, length: int) -> Any:
        torch, loaded = self.torch, self.loaded
        from agent_tools.capture import attention_implementation

        encoded = self.encoded(length)
        ids = encoded.input_ids.to(loaded.device)
        if name == "sdpa":

            def once() -> None:
                with attention_implementation(loaded.model, "sdpa"), torch.inference_mode():
                    loaded.model(input_ids=ids)

            return once
        if name == "flash":
            if importlib.util.find_spec("flash_attn") is None:
                return "skipped: flash-attn is not installed (pip install flash-attn)"
            previous = loaded.model.config._attn_implementation
            loaded.model.set_attn_implementation("flash_attention_2")  # checks the kernels; raises if unusable
            self.restore = lambda: loaded.model.set_attn_implementation(previous)

            def once() -> None:
                with torch.inference_mode():
                    loaded.model(input_ids=ids)

            return once
        if name == "eager":
            maps = loaded.facts.num_layers * loaded.facts.num_heads * length * length * 2  # bf16 maps kept
            total = self.total_memory()
            if maps > total:
                return f"OOM (not tried: the maps alone are {gib(maps):.0f} GiB, the GPU has {gib(total):.0f} GiB)"

            def once() -> None:
                with attention_implementation(loaded.model, "eager"), torch.inference_mode():
                    out = loaded.model(input_ids=ids, output_attentions=True)
                assert len(out.attentions) == loaded.facts.num_layers

            return once
        if name == "stats":
            from agent_tools.consumers.grid import QuantisedMaps

            def once() -> None:
                grid = QuantisedMaps(loaded.facts.num_layers, loaded.facts.num_heads, encoded.length, keep_maps=False)
                self.inspector.run(loaded, encoded, [grid, role_consumer(loaded, encoded)], need_output=False)
                assert torch.isfinite(grid.entropy).all()

            return once
        if name == "analyze":
            from agent_tools.report.job import run_analysis

            text = loaded.tokenizer.decode(encoded.input_ids[0])

            def once() -> None:
                result = run_analysis(self.inspector, text, model=self.args.model)
                for step, why in result.skipped.items():
                    note = f"analyze {length}: {step} skipped: {why}"
                    if note not in self.notes:
                        self.notes.append(note)

            return once
        raise SystemExit(f"unknown config {name}")

    def run_one(self, name: str, length: int) -> dict[str, Any]:
        torch = self.torch
        row: dict[str, Any] = {"config": name, "length": length}
        if self.left_s() <= 0:
            return row | {"skipped": f"skipped: over the {self.args.budget_s:.0f} s time budget"}
        try:
            once = self.config(name, length)
            if isinstance(once, str):
                return row | {"skipped": once}
            return row | self.timed(once)
        except torch.cuda.OutOfMemoryError:
            return row | {"skipped": "OOM", "peak_bytes": self.peak()}
        except Exception as exc:  # one configuration's failure must not lose the others
            reason = (str(exc).strip().splitlines() or [""])[0][:160]
            return row | {"skipped": f"failed: {type(exc).__name__}: {reason}"}
        finally:
            if self.restore is not None:
                self.restore()
                self.restore = None
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()

    def check_parity(self) -> None:
        """Captured weights vs the model's eager output_attentions, on the GPU, on a short text."""
        torch, loaded = self.torch, self.loaded
        from agent_tools.capture import attention_implementation, capture_attention

        encoded = self.encoded(self.args.parity_tokens)
        ids = encoded.input_ids.to(loaded.device)
        keep = KeepWeights()
        with torch.inference_mode():
            with attention_implementation(loaded.model, "eager"):
                reference = loaded.model(input_ids=ids, output_attentions=True).attentions
            with capture_attention(loaded.model, [keep]):
                loaded.model(input_ids=ids)
        diffs, equal = [], 0
        for layer, expected in enumerate(reference):
            got = torch.cat(keep.rows[layer], dim=2)
            diffs.append(float((got.float() - expected.float()).abs().max()))
            equal += bool(torch.equal(got, expected))
        self.parity = {"tokens": int(ids.shape[1]), "layers": len(reference), "equal": equal, "max": max(diffs)}
        self.parity["worst_layer"] = int(max(range(len(diffs)), key=diffs.__getitem__))

    # --- report -----------------------------------------------------------------------------------------
    def markdown(self) -> str:
        torch, loaded = self.torch, self.loaded
        device = torch.cuda.get_device_properties(loaded.device).name if self.cuda else "CPU (--dry-run)"
        import transformers

        flash = importlib.util.find_spec("flash_attn")
        flash_version = "absent"
        if flash is not None:
            import flash_attn

            flash_version = getattr(flash_attn, "__version__", "present")
        lines = [
            f"# Attention inspection cost on the GPU — {self.model_name}, bfloat16, batch 1",
            "",
            f"{device} ({gib(self.total_memory()):.0f} GiB), torch {torch.__version__}, transformers "
            f"{transformers.__version__}, flash-attn {flash_version}. Model loaded in {self.load_s:.1f} s "
            f"({loaded.dtype}, {loaded.device}, weights {gib(self.weights_bytes):.2f} GiB allocated).",
            "",
            f"Median of {self.args.repeats} runs after a warm-up (fewer where the warm-up took over "
            f"{SLOW_WARMUP_S:.0f} s or the {self.args.budget_s:.0f} s budget ran short: see `runs`), one process, "
            "`torch.cuda.synchronize` around each run. `peak` is "
            "`torch.cuda.max_memory_allocated` over the configuration (weights included), reset before each.",
            "",
            f"    {self.args.command}",
            "",
        ]
        if self.parity:
            p = self.parity
            verdict = "bit-identical" if p["equal"] == p["layers"] else f"{p['equal']}/{p['layers']} layers equal"
            lines += [
                f"Parity on the GPU ({p['tokens']} tokens, bfloat16): captured weights vs eager output_attentions: "
                f"{verdict}; max |captured − eager| = {p['max']:.3e} (worst layer {p['worst_layer']}).",
                "",
            ]
        lines += [
            "| tokens | configuration | median wall (s) | runs (s) | × sdpa | peak (GiB) | above weights (GiB) |",
            "|---:|---|---:|---|---:|---:|---:|",
        ]
        floor = {r["length"]: r for r in self.rows if r["config"] == "sdpa" and "median_s" in r}
        for row in self.rows:
            if "median_s" not in row:
                peak = f"{gib(row['peak_bytes']):.1f}" if "peak_bytes" in row else "—"
                lines.append(f"| {row['length']} | {row['config']} | — | {row['skipped']} | — | {peak} | — |")
                continue
            top = floor.get(row["length"])
            ratio = f"{row['median_s'] / top['median_s']:.2f}" if top else "—"
            runs = ", ".join(f"{t:.3f}" for t in row["times_s"])
            peak, above = gib(row["peak_bytes"]), gib(row["peak_bytes"] - self.weights_bytes)
            lines.append(
                f"| {row['length']} | {row['config']} | {row['median_s']:.3f} | {runs} | {ratio} | {peak:.2f} | "
                f"{above:.2f} |"
            )
        if self.notes:
            lines += ["", "Notes:", "", *[f"- {n}" for n in self.notes]]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        Path(self.args.out).write_text(self.markdown())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=LENGTHS)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="model reference (default: load_model()'s default)")
    parser.add_argument("--device", default="cuda", help="cuda or cuda:N")
    parser.add_argument("--parity-tokens", type=int, default=64)
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no configuration after this many s")
    parser.add_argument("--out", default="benchmarks/results-gpu.md")
    parser.add_argument("--dry-run", action="store_true", help="run every step on the CPU (64 tokens, out in /tmp)")
    args = parser.parse_args()
    import torch

    if args.dry_run:
        args.device, args.lengths, args.repeats = "cpu", "64", 1
        args.configs = args.configs if "--configs" in sys.argv else "sdpa,flash,eager,stats"
        args.out = args.out if "--out" in sys.argv else str(Path(tempfile.gettempdir()) / "bench-gpu-dry-run.md")
        args.parity_tokens = min(args.parity_tokens, 16)
    elif not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here (torch.cuda.is_available() is False); nothing measured")
        return 0
    args.command = "python benchmarks/bench_gpu.py " + " ".join(sys.argv[1:])
    bench = Bench(args)
    try:
        bench.check_parity()
    except Exception as exc:
        bench.notes.append(f"parity check failed: {type(exc).__name__}: {str(exc)[:200]}")
    bench.write()
    for length in bench.lengths:
        for name in args.configs.split(","):
            row = bench.run_one(name, length)
            bench.rows.append(row)
            shown = f"{row['median_s']:.3f}s" if "median_s" in row else row["skipped"]
            print(f"{name:8s} {length:6d}  {shown}  ({time.perf_counter() - bench.started:.0f} s elapsed)", flush=True)
            bench.write()
    print(Path(args.out).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
