"""The ``analyze`` report's long-context steps: retrieval heads and the short-cache plan, for texts long enough.

Both steps cost many forwards (``find_retrieval_heads``: one captured pass per haystack and two per ablated head set
and haystack; ``plan_kv_cache``: about 45 forwards' worth on the default model, see
``benchmarks/results-long-context.md``), so the job runs them only when asked (``run_analysis(...,
long_context=True)``) and the text has at least :data:`LONG_CONTEXT_TOKENS` tokens. Their reports join the job's
``reports`` (and ``report.json``) under the tools' names.
"""

from __future__ import annotations

from typing import Any

LONG_CONTEXT_TOKENS = 1024  # a shorter text has no "far back" worth measuring
HAYSTACK_TOKENS = 1024  # haystack length built from the text (the needle at three depths)
RETRIEVAL_DEPTHS = [0.1, 0.5, 0.9]
KV_SINK, KV_WINDOW = 4, 256


def long_context_steps(text: str, model: str | None, tokens: int) -> list[tuple[str, dict[str, Any]]] | str:
    """The (tool, arguments) of the long-context steps, or why there are none for this text."""
    if tokens < LONG_CONTEXT_TOKENS:
        return f"text has {tokens} tokens; the long-context steps need at least {LONG_CONTEXT_TOKENS}"
    base: dict[str, Any] = {"detail": "full"} | ({"model": model} if model else {})
    return [
        (
            "find_retrieval_heads",
            base
            | {"text": text, "lengths": [min(HAYSTACK_TOKENS, tokens)], "depths": RETRIEVAL_DEPTHS, "random_draws": 2},
        ),
        ("plan_kv_cache", base | {"text": text, "sink": KV_SINK, "window": KV_WINDOW, "context_length": tokens}),
    ]
