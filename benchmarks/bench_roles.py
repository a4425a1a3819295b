"""Cost of profile_heads' role evidence on the default model (issue 24), as a multiple of one plain forward.

  plain        one forward of the sample text (38 tokens on SmolLM2-135M), logits included
  scores       role scores only: the text and one probe (held_out_texts 0, seeds 1, no ablation checks)
  spread       scores with their spread: the text + 2 held-out texts, 3 probes (no ablation checks)
  single       spread + the single-head checks: top-3 previous-token and induction heads and 8 random heads,
               mean-ablated, as rows of one batched forward over the probe (after one recorded clean run)
  default      single + the joint induction check: the top-3 induction heads together and 8 random sets of 3,
               two forwards each (the runner's multi-head ablation records the means on its own clean pass)

Median of N warm runs in one process (the model loaded once), after one warm-up. Waits (up to 10 minutes) for the
1-minute load average to fall under 2 before it starts, and says what it found.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_roles.py --repeats 3
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
from bench_evidence import wait_for_quiet

VARIANTS = {
    "scores": {"held_out_texts": 0, "seeds": 1, "ablate_top": 0, "induction_check": False},
    "spread": {"ablate_top": 0, "induction_check": False},
    "single": {"induction_check": False},
    "default": {},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-wait", action="store_true", help="start at once, whatever the load")
    args = parser.parse_args()
    load = os.getloadavg()[0] if args.no_wait else wait_for_quiet()

    import torch

    from agent_tools.inspector import Inspector
    from agent_tools.tools import get_tool
    from agent_tools.tools.profile_heads import SAMPLE_TEXT

    inspector = Inspector()
    loaded = inspector.model(None)
    encoded = inspector.encode(loaded, SAMPLE_TEXT)

    def plain() -> None:
        with torch.inference_mode():
            loaded.model(input_ids=encoded.input_ids)

    forward = statistics.median(warm_times(plain, max(args.repeats, 5)))
    tool = get_tool("profile_heads")
    print(f"load average {load:.1f}; {loaded.name}, {encoded.length} tokens; plain forward {forward * 1000:.0f} ms")
    print("| variant | seconds | × plain forward |\n|---|---|---|")
    for name, arguments in VARIANTS.items():
        seconds = statistics.median(warm_times(lambda arguments=arguments: tool(inspector, arguments), args.repeats))
        print(f"| {name} | {seconds:.2f} | {seconds / forward:.1f} |", flush=True)


if __name__ == "__main__":
    main()
