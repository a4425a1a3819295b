"""Cost of diagnose_collapse's causal check on the default model (issue 24), as a multiple of a plain forward.

The check mean- and resample-ablates up to 8 collapsed heads, all of them together, and the same for random
non-collapsed heads (8 draws each), as rows of batched forwards (``runner/ablation.py: ablated_rows``). Reports the
median warm time of a plain forward of the text, of diagnose_collapse with ``causal_check: false`` and with it, the
check's cost (the difference) in plain forwards, and the work it did in forward-equivalents (layer rows ÷ layers).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_collapse_check.py --repeats 3
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_collapse_check.py --tokens 60 --repeats 3
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

from bench_attention import make_text, warm_times

EXAMPLE = "The cat sat on the mat because it was tired."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=0, help="a generated text of this many tokens (0: the example)")
    options = parser.parse_args()

    import torch

    from agent_tools.inspector import Inspector
    from agent_tools.tools import get_tool

    inspector = Inspector()
    loaded = inspector.model(None)
    text = EXAMPLE
    if options.tokens:
        ids = loaded.tokenizer(make_text(loaded.tokenizer, options.tokens))["input_ids"][: options.tokens]
        text = loaded.tokenizer.decode(ids)
    encoded = inspector.encode(loaded, text)

    def plain() -> None:
        with torch.inference_mode():
            loaded.model(input_ids=encoded.input_ids, use_cache=False)

    tool = get_tool("diagnose_collapse")
    forward = statistics.median(warm_times(plain, options.repeats))
    off = statistics.median(warm_times(lambda: tool(inspector, {"text": text, "causal_check": False}), options.repeats))
    report = tool(inspector, {"text": text})
    on = statistics.median(warm_times(lambda: tool(inspector, {"text": text}), options.repeats))
    assert report.check is not None
    print(f"text: {encoded.length} tokens; plain forward {forward:.3f} s")
    print(f"diagnose_collapse: {off:.2f} s without the check, {on:.2f} s with it")
    print(
        f"check: {on - off:.2f} s = {(on - off) / forward:.1f} plain forwards; work {report.check.forward_equivalents} "
        f"forward-equivalents ({report.check.checked} heads checked, baseline {report.check.baseline})"
    )


if __name__ == "__main__":
    main()
