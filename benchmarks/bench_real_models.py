"""Real-model honesty checks that need timing or peak memory (issue 30), each in a fresh process.

  memory   the pre-load estimate (weights + checkpoint copy while converting, or + one pass's working set) against
           the measured peak resident memory (VmHWM of the child process, not ru_maxrss: see peak_bytes) of loading
           a bfloat16 checkpoint and running one forward; then the working set of a second forward alone
  subset   the cost of capturing one late layer (every layer before it runs the eager math) against the plain
           sdpa forward and capturing every layer
  dtype    float32 against bfloat16 forward time on this CPU (what ``auto`` should pick)

    python benchmarks/bench_real_models.py memory --hidden 768 --layers 12 --tokens 512   # ~1 min
    python benchmarks/bench_real_models.py subset --tokens 512                             # default model
    python benchmarks/bench_real_models.py dtype --tokens 512
    python benchmarks/bench_real_models.py memory --hidden 2048 --layers 16 --vocab 128256 --tokens 2048  # 1B shape

Prints one Markdown row per measurement. Timing targets live here, never in the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def rss_bytes() -> int:
    return _status_bytes("VmRSS")


def reset_peak() -> None:
    """Start VmHWM again from the current resident memory (Linux ≥ 4.0: ``5`` to /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_bytes() -> int:
    """This process's own peak resident memory: VmHWM, the high-water mark of its address space.

    Not ``ru_maxrss``: Linux carries the parent's high-water mark into a child across fork and exec
    (``setmax_mm_hiwater_rss`` in exec_mmap), so a child started by a parent that had built a model reports the
    parent's peak whenever its own is lower (this made bfloat16 read 1.25× its estimate here, 0.8× by hand)."""
    return _status_bytes("VmHWM")


def memory_child(folder: str, dtype_name: str, tokens: int) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from agent_tools.placement import estimate_memory

    dtype = getattr(torch, dtype_name)
    config = AutoConfig.from_pretrained(folder)
    estimate = estimate_memory(config, dtype, causal=True, folder=folder, tokens=tokens)
    reset_peak()
    baseline = rss_bytes()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    after_load = peak_bytes() - baseline
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    with torch.inference_mode():
        model(input_ids=ids).logits.float()
    measured = peak_bytes() - baseline
    reset_peak()  # the second pass alone: its rise over the resident weights is the working set
    before_pass = rss_bytes()
    with torch.inference_mode():
        model(input_ids=ids).logits.float()
    return {
        "dtype": dtype_name,
        "estimate_peak": estimate.peak,
        "weights": estimate.weights,
        "load_copy": estimate.load_copy,
        "working_set": estimate.working_set,
        "measured_load_peak": after_load,
        "measured_peak": measured,
        "measured_weights": before_pass - baseline,
        "measured_working_set": peak_bytes() - before_pass,
    }


def run_memory(args: argparse.Namespace) -> None:
    import torch
    import transformers as tf

    config = tf.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
        max_position_embeddings=max(4096, args.tokens), tie_word_embeddings=True,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        tf.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(scratch)  # a bfloat16 checkpoint
        print(
            "| load dtype | estimate (peak) | measured peak | measured / estimate | weights est. / meas. "
            "| load peak est. / meas. | working set est. / meas. |"
        )
        print("|---|---|---|---|---|---|---|")
        for dtype in ("float32", "bfloat16"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", "memory", scratch, dtype, str(args.tokens)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            gib = 2**30
            print(
                f"| {dtype} | {row['estimate_peak'] / gib:.3f} GiB | {row['measured_peak'] / gib:.3f} GiB | "
                f"{row['measured_peak'] / row['estimate_peak']:.2f} | "
                f"{row['weights'] / gib:.3f} / {row['measured_weights'] / gib:.3f} | "
                f"{(row['weights'] + row['load_copy']) / gib:.3f} / {row['measured_load_peak'] / gib:.3f} | "
                f"{row['working_set'] / gib:.3f} / {row['measured_working_set'] / gib:.3f} |"
            )


def timed(call, repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run_subset(args: argparse.Namespace) -> None:
    import torch

    from agent_tools.capture import capture_attention
    from agent_tools.loading import load_model

    loaded = load_model(None)
    model = loaded.model
    layers = loaded.facts.num_layers
    ids = torch.randint(100, 10000, (1, args.tokens))

    def plain() -> None:
        with torch.inference_mode():
            model.model(input_ids=ids)

    def capture(subset: list[int] | None) -> None:
        with torch.inference_mode(), capture_attention(model, [], layers=subset, query_chunk=args.chunk):
            model.model(input_ids=ids)

    print(f"| {args.tokens} tokens, {layers} layers | median s |")
    print("|---|---|")
    print(f"| sdpa forward | {timed(plain, args.repeats):.3f} |")
    print(f"| capture layer {layers - 2} only | {timed(lambda: capture([layers - 2]), args.repeats):.3f} |")
    print(f"| capture every layer | {timed(lambda: capture(None), args.repeats):.3f} |")


def run_dtype(args: argparse.Namespace) -> None:
    import torch

    from agent_tools.loading import load_model

    model = load_model(None).model
    ids = torch.randint(100, 10000, (1, args.tokens))
    print(f"| {args.tokens} tokens | median s |")
    print("|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)

        def forward() -> None:
            with torch.inference_mode():
                model.model(input_ids=ids)

        print(f"| {str(dtype).removeprefix('torch.')} sdpa forward | {timed(forward, args.repeats):.3f} |")
    model.to(torch.float32)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _, _, _, folder, dtype, tokens = sys.argv
        print(json.dumps(memory_child(folder, dtype, int(tokens))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("memory", "subset", "dtype"))
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    {"memory": run_memory, "subset": run_subset, "dtype": run_dtype}[args.what](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
