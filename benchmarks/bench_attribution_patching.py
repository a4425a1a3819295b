"""Attribution patching against exact patching of every head: recall and time (issue 26).

For each prompt pair (an IOI-style pair, a repeated-sequence induction pair, a factual-recall pair), on the default
model or a random-weight model of a real shape:

* exact: every head patched alone, batched (``patch_heads`` method ``exact``'s passes), timed;
* attribution: one clean pass, one corrupted pass and a backward (the estimate of every head), timed, with GradDrop
  rows when ``--grad-drop``;
* recall: how many of exact patching's top-10 heads (by |restored|) attribution's top-10 holds, and Spearman's ρ of
  |estimate| and |exact| over every head;
* forward-equivalents: each method's seconds over one plain forward of the corrupted prompt (same process, same
  load), the figure the issue's "≤ 3 forward-equivalents, independent of the number of heads" is about.

AtP*'s saturation fix is on unless ``--plain`` (the heads it corrected are counted in ``saturated``).

    python benchmarks/bench_attribution_patching.py                       # default model, three pairs (~1 min)
    python benchmarks/bench_attribution_patching.py --shape llama-3.2-1b  # random weights, the real shape
    python benchmarks/bench_attribution_patching.py --shape qwen2.5-1.5b --layers 2   # its first 2 layers only
    python benchmarks/bench_attribution_patching.py --plain               # without AtP*'s saturation fix
    python benchmarks/bench_attribution_patching.py --out benchmarks/results-attribution.md

Timing targets live here, never in the tests.
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

PAIRS = {  # name -> (clean, corrupted, answer, wrong)
    "ioi": (
        "When John and Mary went to the store, John gave a drink to",
        "When John and Mary went to the store, Mary gave a drink to",
        " Mary",
        " John",
    ),
    "induction": (
        "tree lamp sun river blue cat door moon. tree lamp sun river blue cat door",
        "tree lamp sun river blue cat door fish. tree lamp sun river blue cat door",
        " moon",
        " fish",
    ),
    "factual": (
        "The capital of France is the city of",
        "The capital of Italy is the city of",
        " Paris",
        " Rome",
    ),
}
SHAPES = {  # random-weight models of real configs (no download: the config only)
    "llama-3.2-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
}
TOP = 10


def _model(shape: str | None, layers: int | None):
    from agent_tools.loading import load_model, register_model

    if shape is None:
        return load_model("smollm2-135m-instruct")
    import torch
    import transformers as tf

    spec = dict(SHAPES[shape])
    if layers is not None:
        spec["num_hidden_layers"] = layers
    config = tf.AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    tokenizer = load_model("smollm2-135m-instruct").tokenizer  # ids stay below every shape's vocabulary
    suffix = f"-{layers}l" if layers is not None else ""
    return register_model(f"bench-{shape}{suffix}", model, tokenizer)


def measure(
    loaded,
    inspector,
    name: str,
    pair: tuple[str, str, str, str],
    *,
    grad_drop: bool,
    saturation_fix: bool,
    repeats: int = 1,
) -> dict:
    import torch

    from agent_tools.analysis.attribution import spearman
    from agent_tools.tools import get_tool

    clean, corrupted, answer, wrong = pair
    arguments = {
        "model": loaded.name,
        "clean": clean,
        "corrupted": corrupted,
        "answer": answer,
        "wrong": wrong,
        "method": "exact",
        "per_position": False,
        "detail": "full",
    }
    started = time.perf_counter()
    report = get_tool("patch_heads")(inspector, arguments)
    exact_seconds = time.perf_counter() - started
    exact = {(h.layer, h.head): h.logit_difference - report.logit_difference_corrupted for h in report.heads}
    encoded = [inspector.encode(loaded, text) for text in (clean, corrupted)]
    answer_id, wrong_id = report.answer_id, report.wrong_id

    def metric(_clean: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, answer_id] - logits[:, wrong_id]

    attribution_times, forward_times = [], []
    for _ in range(repeats):  # interleaved, so a change of load moves both; the medians are reported
        started = time.perf_counter()
        passes = inspector.attribution_passes(
            loaded, encoded[0], encoded[1], metric, grad_drop=grad_drop, saturation_fix=saturation_fix
        )
        attribution_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        with torch.inference_mode():
            loaded.model(input_ids=encoded[1].input_ids, use_cache=False, logits_to_keep=1)
        forward_times.append(time.perf_counter() - started)
    attribution_seconds = statistics.median(attribution_times)
    forward_seconds = statistics.median(forward_times)
    estimate = {key: float(passes.heads.sum(1)[key]) for key in exact}
    exact_top = sorted(exact, key=lambda k: -abs(exact[k]))[:TOP]
    estimate_top = sorted(estimate, key=lambda k: -abs(estimate[k]))[:TOP]
    keys = list(exact)
    rho = spearman([abs(estimate[k]) for k in keys], [abs(exact[k]) for k in keys])
    return {
        "pair": name,
        "tokens": encoded[0].length,
        "heads": len(keys),
        "recall": len(set(exact_top) & set(estimate_top)),
        "rho": rho,
        "exact_s": exact_seconds,
        "attribution_s": attribution_seconds,
        "forward_s": forward_seconds,
        "gap": report.logit_difference_clean - report.logit_difference_corrupted,
        "missed": [f"L{k[0]}H{k[1]}" for k in exact_top if k not in estimate_top],
        "saturated": sum(len(v) for v in (passes.saturated or {}).values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random weights of a real shape")
    parser.add_argument("--pairs", default=",".join(PAIRS))
    parser.add_argument("--grad-drop", action="store_true")
    parser.add_argument("--plain", action="store_true", help="without AtP*'s saturation fix")
    parser.add_argument("--layers", type=int, default=None, help="--shape: only the first N layers")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=1, help="time attribution and a forward N times (medians)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from agent_tools.inspector import Inspector

    loaded = _model(args.shape, args.layers)
    inspector = Inspector()
    fix = not args.plain
    rows = [
        measure(
            loaded, inspector, name, PAIRS[name], grad_drop=args.grad_drop, saturation_fix=fix, repeats=args.repeats
        )
        for name in args.pairs.split(",")
    ]
    lines = [
        f"model: {loaded.name}; GradDrop: {args.grad_drop}; AtP* saturation fix: {fix}; "
        f"times: median of {args.repeats}",
        "",
        "| pair | tokens | heads | LD gap | recall@10 | ρ | exact s (fwd-eq) | attribution s (fwd-eq) | forward s | "
        "saturated | missed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rho = f"{r['rho']:.2f}" if r["rho"] is not None else "-"
        lines.append(
            f"| {r['pair']} | {r['tokens']} | {r['heads']} | {r['gap']:.2f} | {r['recall']}/10 | {rho} | "
            f"{r['exact_s']:.2f} ({r['exact_s'] / r['forward_s']:.0f}) | "
            f"{r['attribution_s']:.2f} ({r['attribution_s'] / r['forward_s']:.1f}) | {r['forward_s']:.3f} | "
            f"{r['saturated']} | {' '.join(r['missed'])} |"
        )
    lines.append("")
    lines.append(
        f"median attribution/forward: {statistics.median(r['attribution_s'] / r['forward_s'] for r in rows):.1f}×"
    )
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
