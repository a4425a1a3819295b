"""The trace's causal check by attribution against the plain trace and against ablating every segment (issue 26).

On the default model and bench_evidence's ~700-token RAG chat with 6 content segments (system#1, doc1..doc4,
user#1): the plain trace (no checks), the causal check as the trace runs it now (every segment estimated by one
forward and one backward, the top 3 and one random segment removed and replaced exactly), and the causal check
ablating every segment exactly (what the trace did before, forced here by raising the threshold). The issue's
target is the causal trace ≤ 2× the plain trace.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_trace_causal.py --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

from bench_attention import warm_times
from bench_evidence import rag_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-every", action="store_true", help="skip the every-segment-ablated row (shorter)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from agent_tools import segment_attribution
    from agent_tools.inspector import Inspector
    from agent_tools.tools import get_tool

    inspector = Inspector()
    loaded = inspector.model(None)
    messages, segments = rag_prompt(loaded.tokenizer)
    base = {"prompt": messages, "segments": segments, "detail": "full"}
    trace = get_tool("trace_prompt_attention")
    load_before = os.getloadavg()[0]

    def timed(arguments: dict, warm_up: bool) -> tuple[float, object]:
        results: list[object] = []
        times = warm_times(lambda: results.append(trace(inspector, arguments)), args.repeats, warm_up=warm_up)
        return statistics.median(times), results[-1]

    plain, report = timed({**base, "checks": []}, True)
    estimated, by_attribution = timed({**base, "checks": ["causal"]}, False)
    print(f"plain {plain:.2f} s, causal by attribution {estimated:.2f} s", file=sys.stderr, flush=True)
    every, exact = None, None
    if not args.skip_every:
        kept = segment_attribution.VERIFIED
        segment_attribution.VERIFIED = 100  # every segment ablated exactly, as before the estimate
        try:
            every, exact = timed({**base, "checks": ["causal"]}, False)
        finally:
            segment_attribution.VERIFIED = kept
    check = by_attribution.causal_attribution
    length = report.num_tokens
    ids = torch.arange(100, 100 + length)[None]
    with torch.inference_mode():
        forward = statistics.median(
            warm_times(lambda: loaded.model(input_ids=ids, use_cache=False, logits_to_keep=1), 3, warm_up=True)
        )
    # the exact checks' tokens (each row runs the positions from its segment's first token; on a CPU the removed
    # row alone, without the segment's length of padding), in prompt lengths: their floor in forwards
    spans = {s.name: s.positions for s in by_attribution.segments}
    checked_tokens = sum(2 * (length - min(spans[r.segment])) - len(spans[r.segment]) for r in check.checked)
    rows = [
        (f"trace, no checks ({report.num_tokens} tokens)", plain, "1.00x"),
        ("trace, causal: all segments estimated, top 3 + 1 random ablated", estimated, f"{estimated / plain:.2f}x"),
    ]
    if every is not None:
        rows.append(("trace, causal: every segment ablated (before)", every, f"{every / plain:.2f}x"))
    checked = ", ".join(
        f"{r.segment} ({r.chosen}: exact {r.exact:+.3f}, estimate {r.estimate:+.3f})" for r in check.checked
    )
    exact_all = {s.name: s.causal.answer_neutral for s in exact.segments if s.causal is not None} if exact else {}
    lines = [
        "| what | seconds | vs plain trace |",
        "|---|---:|---:|",
        *(f"| {what} | {seconds:.2f} | {ratio} |" for what, seconds, ratio in rows),
        "",
        f"`{loaded.name}`, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, median of "
        f"{args.repeats}; "
        f"1-minute load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.",
        f"One forward of the prompt (sdpa, no capture) {forward:.2f} s: the plain trace is {plain / forward:.2f} "
        f"forwards, the causal check adds {(estimated - plain) / forward:.2f}, of which the exact checks' tokens "
        f"are {checked_tokens / length:.2f} prompt lengths ({checked_tokens} tokens).",
        f"Checked: {checked}; unchecked: {', '.join(check.unchecked)}; ρ(|estimate|, |exact|) {check.spearman}.",
    ]
    if exact_all:
        lines.append(
            "Every segment ablated exactly, Δ Σ log p with neutral tokens: "
            + ", ".join(f"{name} {value:+.3f}" for name, value in exact_all.items())
            + "."
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
