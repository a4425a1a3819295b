"""Cost of the evidence beside attention, on the default model (issue 16).

  trace        trace_prompt_attention on a ~700-token RAG chat with 6 content segments: plain (no checks), value
               shares only, the default (causal + value), causal only; target <= 4x the plain trace
  gradient     the same trace with integrated gradients (32 steps), reported separately
  patch_heads  all 270 heads (+ 30 layers) patched on a 20-token IOI pair; target <= 3 s

Median of N warm runs in one process (the model loaded once), after one warm-up. Waits (up to 10 minutes) for the
1-minute load average to fall under 2 before it starts, and says what it found.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_evidence.py --repeats 3 --out benchmarks/results-evidence.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

from bench_attention import make_text, warm_times

QUESTION = "Question: What is the access code of the archive? Answer with the code only."
FACT = " The access code of the archive is 4721."
IOI_CLEAN = "When Mary and John went to the store on a cold and rainy afternoon, John gave a bottle of water to"
IOI_CORRUPTED = "When Mary and John went to the store on a cold and rainy afternoon, Mary gave a bottle of water to"


def wait_for_quiet(limit: float = 2.0, patience: float = 600.0) -> float:
    """Sleep in 60 s steps until the 1-minute load average is under ``limit`` (at most ``patience`` seconds)."""
    waited = 0.0
    while os.getloadavg()[0] >= limit and waited < patience:
        time.sleep(60)
        waited += 60
    return os.getloadavg()[0]


def rag_prompt(tokenizer, tokens_per_doc: int = 160) -> tuple[list[dict], list[dict]]:
    """A system message and a user message of four ~160-token documents (the third holds the fact) + question."""
    docs = [" ".join(make_text(tokenizer, tokens_per_doc, seed=i).split()[: tokens_per_doc // 2 * 2]) for i in range(4)]
    docs[2] += FACT
    messages = [
        {"role": "system", "content": "Answer the question from the documents."},
        {"role": "user", "content": "\n\n".join(docs) + "\n\n" + QUESTION},
    ]
    return messages, [{"name": f"doc{i + 1}", "text": d} for i, d in enumerate(docs)]


def timed(call, repeats: int, *, warm_up: bool = True) -> tuple[float, object]:
    """The median seconds of ``repeats`` warm calls, and the last call's result."""
    results: list[object] = []
    times = warm_times(lambda: results.append(call()), repeats, warm_up=warm_up)
    return statistics.median(times), results[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ig-repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--parts", default="trace,gradient,patch", help="comma-separated: trace, gradient, patch")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    load_before = wait_for_quiet()

    import torch

    from agent_tools.inspector import Inspector

    inspector = Inspector()
    loaded = inspector.model(None)
    messages, segments = rag_prompt(loaded.tokenizer)
    base = {"prompt": messages, "segments": segments}
    rows: list[tuple[str, float, str]] = []
    notes: list[str] = []
    _trace_rows(inspector, base, args, parts, rows, notes)
    if "patch" in parts:
        _patch_rows(inspector, args.repeats, rows, notes)
    lines = [
        "# Evidence checks: cost on the default model",
        "",
        f"`{loaded.name}`, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, median of "
        f"{args.repeats} warm runs (integrated gradients: {args.ig_repeats}); 1-minute load average "
        f"{load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at the end.",
        "",
        "| what | seconds | vs plain trace |",
        "|---|---:|---:|",
        *(f"| {what} | {seconds:.2f} | {ratio} |" for what, seconds, ratio in rows),
        "",
        " ".join(notes),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


def _trace_rows(inspector, base: dict, args, parts: set[str], rows: list, notes: list[str]) -> None:
    """The plain trace, then each check (and integrated gradients), as rows against the plain trace."""
    from agent_tools.tools import get_tool

    trace = get_tool("trace_prompt_attention")
    plain, report = timed(lambda: trace(inspector, {**base, "checks": []}), args.repeats)
    content = sum(1 for s in report.segments if s.kind in {"system", "user", "named"} and s.token_count)
    rows.append((f"trace, no checks ({report.num_tokens} tokens, {content} content segments)", plain, "1.00x"))
    if "trace" in parts:
        for label, checks in (("value", ["value"]), ("causal", ["causal"]), ("causal + value (default)", None)):
            extra = {} if checks is None else {"checks": checks}
            seconds, report = timed(lambda extra=extra: trace(inspector, {**base, **extra}), args.repeats)
            rows.append((f"trace, {label}", seconds, f"{seconds / plain:.2f}x"))
        notes.append(f"Depends on most: {report.depends_on_most!r}.")
    if "gradient" in parts:
        call = {**base, "checks": ["gradient"], "ig_steps": 32}
        seconds, gradient = timed(lambda: trace(inspector, call), args.ig_repeats, warm_up=False)
        rows.append(("trace, integrated gradients (32 steps) + gradient x input", seconds, f"{seconds / plain:.2f}x"))
        run = gradient.gradient_run
        notes.append(f"Gradient run: relative delta {run.relative_delta} (delta {run.delta}).")


def _patch_rows(inspector, repeats: int, rows: list, notes: list[str]) -> None:
    """patch_heads over every head and layer on the IOI pair, without and with the per-position patches."""
    from agent_tools.tools import get_tool

    patch = get_tool("patch_heads")
    pair = {"clean": IOI_CLEAN, "corrupted": IOI_CORRUPTED, "answer": " Mary", "wrong": " John"}
    seconds, patched = timed(lambda: patch(inspector, {**pair, "per_position": False}), repeats)
    rows.append((f"patch_heads, {patched.patched_runs} rows ({patched.tokens} tokens)", seconds, "target <= 3 s"))
    seconds, patched_pp = timed(lambda: patch(inspector, pair), repeats)
    rows.append((f"patch_heads + per position ({patched_pp.patched_runs} rows)", seconds, ""))
    top = patched.top_heads[0]
    notes.append(
        f"patch_heads: first difference at position {patched.first_difference}; top head L{top.layer}H{top.head} "
        f"restores {top.restored:.1%}."
    )


if __name__ == "__main__":
    main()
