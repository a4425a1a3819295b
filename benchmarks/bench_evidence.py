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

from bench_attention import make_text

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


def timed(call, repeats: int) -> tuple[float, object]:
    result = call()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ig-repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_before = wait_for_quiet()

    import torch

    from agent_tools.inspector import Inspector
    from agent_tools.tools import get_tool

    inspector = Inspector()
    loaded = inspector.model(None)
    messages, segments = rag_prompt(loaded.tokenizer)
    trace = get_tool("trace_prompt_attention")
    base = {"prompt": messages, "segments": segments}
    rows: list[tuple[str, float, str]] = []
    plain, report = timed(lambda: trace(inspector, {**base, "checks": []}), args.repeats)
    tokens = report.num_tokens
    content = sum(1 for s in report.segments if s.kind in {"system", "user", "named"} and s.token_count)
    rows.append((f"trace, no checks ({tokens} tokens, {content} content segments)", plain, "1.00x"))
    for label, checks in (("value", ["value"]), ("causal", ["causal"]), ("causal + value (default)", None)):
        extra = {} if checks is None else {"checks": checks}
        seconds, report = timed(lambda extra=extra: trace(inspector, {**base, **extra}), args.repeats)
        rows.append((f"trace, {label}", seconds, f"{seconds / plain:.2f}x"))
    depends = report.depends_on_most
    seconds, gradient = timed(
        lambda: trace(inspector, {**base, "checks": ["gradient"], "ig_steps": 32}), args.ig_repeats
    )
    rows.append(("trace, integrated gradients (32 steps) + gradient x input", seconds, f"{seconds / plain:.2f}x"))
    patch = get_tool("patch_heads")
    pair = {"clean": IOI_CLEAN, "corrupted": IOI_CORRUPTED, "answer": " Mary", "wrong": " John"}
    seconds, patched = timed(lambda: patch(inspector, {**pair, "per_position": False}), args.repeats)
    rows.append((f"patch_heads, {patched.patched_runs} rows ({patched.tokens} tokens)", seconds, "target <= 3 s"))
    seconds_pp, patched_pp = timed(lambda: patch(inspector, pair), args.repeats)
    rows.append((f"patch_heads + per position ({patched_pp.patched_runs} rows)", seconds_pp, ""))
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
        f"Depends on most: {depends!r}; gradient run: relative delta {gradient.gradient_run.relative_delta} "
        f"(delta {gradient.gradient_run.delta}). patch_heads top head: L{patched.top_heads[0].layer}"
        f"H{patched.top_heads[0].head} restores {patched.top_heads[0].restored:.1%}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
