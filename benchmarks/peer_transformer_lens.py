"""Peer-library row for benchmarks/bench_attention.py: TransformerLens capturing Q/K/V and attention for all layers.

Run it with the PEER venv's python, never the project's (it must not import ``agent_tools``):

    /work/peer-venv/bin/python benchmarks/peer_transformer_lens.py --length 512 --repeats 2
    /work/peer-venv/bin/python benchmarks/peer_transformer_lens.py --length 128 --check   # vs HF eager, then exit

It prints one JSON line: config, length, median_s, times_s, peak_rss_mb, after_load_rss_mb, version, api.

Setting up the peer venv (offline except the PyPI registry; torch pinned so pip never pulls a CUDA build):

    python3 -m venv /work/peer-venv
    echo "torch==2.13.0" > /tmp/c.txt
    /work/peer-venv/bin/pip install -c /tmp/c.txt torch==2.13.0
    /work/peer-venv/bin/pip install -c /tmp/c.txt torch==2.13.0 transformer-lens==4.3.0

(transformer-lens 4.3.0 pulls transformers 5.24.0, accelerate, wandb, datasets, ... — about 75 packages.)

What is timed: TransformerLens 4.x has no ``HookedTransformer`` any more (removed in 4.0); its API is
``TransformerBridge.boot_transformers(path)``, which wraps the Hugging Face model, forces eager attention and
keeps the raw HF weights (no LayerNorm folding or centring, so numbers match HF exactly). One forward under
``torch.inference_mode`` with ``run_with_cache(ids, names_filter=...)`` keeps, for every one of the 30 layers:
``attn.hook_q`` (1,T,9,64), ``attn.hook_k`` / ``attn.hook_v`` (1,T,3,64) (projections before RoPE),
``attn.hook_rot_q`` / ``attn.hook_rot_k`` (after RoPE, what the scores use) and ``attn.hook_pattern``
(1,9,T,T) softmaxed weights, float32. All layers' tensors are held at once in the returned cache (the
patterns alone are 30·9·T²·4 bytes: 283 MB at 512 tokens, 4.5 GB at 2,048). The logits are computed too.

The model is the project's converted float32 safetensors copy of SmolLM2-135M-Instruct in the cache folder
(``$ATTENTION_EXPLAINER_CACHE`` or ``~/.cache/attention-explainer``, ``gguf/SmolLM2-135M-Instruct*``);
create it once with the project's venv (``python -c "from agent_tools.loading import load_model; load_model()"``)
or pass ``--model-path``. Loaded offline (HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1). The text is the same
random-word text as bench_attention.py's ``make_text``, cut to exactly N tokens. The glibc allocator is tuned as
bench_attention.py does for every configuration (``--no-tune-allocator`` to skip it).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).parent))
from bench_attention import make_text  # the same text as every other row (a stdlib-only module)

HOOKS = ("hook_q", "hook_k", "hook_v", "hook_rot_q", "hook_rot_k", "hook_pattern")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tune_allocator() -> bool:
    """The same glibc mallopt setting agent_tools.runtime.tune_allocator applies (1 GiB mmap/trim thresholds)."""
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(-3, 1 << 30)) and bool(mallopt(-1, 1 << 30))  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


def find_model_folder() -> Path:
    """The project's converted SmolLM2-135M-Instruct folder in its cache (prefer one whose GGUF source exists)."""
    base = os.environ.get("ATTENTION_EXPLAINER_CACHE")
    cache = (
        Path(base).expanduser()
        if base
        else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attention-explainer"
    )
    found = [
        f
        for f in sorted(cache.glob("gguf/SmolLM2-135M-Instruct*"))
        if (f / "config.json").is_file() and (f / "model.safetensors").is_file() and (f / "tokenizer.json").is_file()
    ]
    if not found:
        raise SystemExit(
            f"no converted SmolLM2-135M-Instruct folder under {cache}/gguf; create it with the project's venv: "
            'python -c "from agent_tools.loading import load_model; load_model()", or pass --model-path'
        )

    def source_exists(folder: Path) -> bool:
        try:
            return Path(json.loads((folder / "attention_explainer_source.json").read_text())["gguf"]).is_file()
        except (OSError, ValueError, KeyError):
            return False

    return sorted(found, key=lambda f: (source_exists(f), f.stat().st_mtime))[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-path", help="converted model folder (default: found in the project's cache)")
    parser.add_argument("--no-tune-allocator", action="store_true")
    parser.add_argument("--check", action="store_true", help="compare with HF eager output_attentions, then exit")
    args = parser.parse_args()

    tuned = False if args.no_tune_allocator else tune_allocator()
    import importlib.metadata

    import torch
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    folder = Path(args.model_path) if args.model_path else find_model_folder()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    bridge = TransformerBridge.boot_transformers(str(folder), device="cpu", dtype=torch.float32, tokenizer=tokenizer)
    bridge.eval()
    ids = tokenizer(make_text(tokenizer, args.length), return_tensors="pt")["input_ids"][:, : args.length]
    layers = bridge.cfg.n_layers
    wanted = {f"blocks.{layer}.attn.{hook}" for layer in range(layers) for hook in HOOKS}
    baseline = peak_rss_mb()

    def once():
        with torch.inference_mode():
            logits, cache = bridge.run_with_cache(ids, names_filter=lambda name: name in wanted)
        assert set(cache.keys()) == wanted, sorted(wanted - set(cache.keys()))[:5]
        return logits, cache

    if args.check:
        from transformers import AutoModelForCausalLM

        logits, cache = once()
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
        with torch.inference_mode():
            out = hf(input_ids=ids, output_attentions=True)
        diffs = [
            (out.attentions[layer] - cache[f"blocks.{layer}.attn.hook_pattern"]).abs().max().item()
            for layer in range(layers)
        ]
        print(
            json.dumps(
                {
                    "length": int(ids.shape[1]),
                    "layer0_pattern_max_abs_diff": diffs[0],
                    "all_layers_pattern_max_abs_diff": max(diffs),
                    "logits_max_abs_diff": (out.logits - logits).abs().max().item(),
                    "shapes": {k: list(cache[k].shape) for k in sorted(cache.keys()) if k.startswith("blocks.0.")},
                }
            )
        )
        return 0

    once()  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "config": "transformer_lens",
                "length": int(ids.shape[1]),
                "median_s": statistics.median(times),
                "times_s": times,
                "peak_rss_mb": peak_rss_mb(),
                "after_load_rss_mb": baseline,
                "version": importlib.metadata.version("transformer-lens"),
                "api": "TransformerBridge.boot_transformers + run_with_cache(names_filter) under inference_mode",
                "hooks_per_layer": list(HOOKS),
                "allocator_tuned": tuned,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
