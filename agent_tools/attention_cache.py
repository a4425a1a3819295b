"""A named cache of every map of a short text, for people exploring in a notebook (TransformerLens' habit).

::

    from agent_tools.attention_cache import capture_maps

    cache = capture_maps("smollm2-135m-instruct", "When Mary and John went to the store, John gave a drink to")
    cache["L18H6"].pattern          # (q, k) the softmax weights the model used
    cache["L18H6"].scores           # (q, k) q·kᵀ·scale (+ the family's score terms), before the mask
    cache["L18H6"].q, .k, .v        # (q, D), (k, D), (k, D): after projection and rotary embeddings
    cache["pattern", 18]            # (H, q, k) every head of layer 18
    cache.tokens                    # the row and column labels

Every map is captured by the same hook as the tools (:func:`agent_tools.capture.capture_attention`), so it equals
the model's own eager attention, and copied to the CPU in float32. What a cache would hold is estimated before
the pass and refused over the session's memory budget: for long texts stream a consumer through
``capture_attention`` (``agent_tools/consumers/`` has one per statistic) or use the tools, which never hold maps.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

import torch
from torch import Tensor

from agent_tools.capture import LayerAttention
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.families import StackFacts
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel
from agent_tools.schemas import Token

CacheField = Literal["pattern", "scores", "q", "k", "v", "output"]
CACHE_FIELDS: tuple[str, ...] = get_args(CacheField)
_HEAD_LABEL = re.compile(r"^L(\d+)H(\d+)$")
_FLOAT32 = 4


@dataclass(frozen=True)
class HeadMaps:
    """One head's tensors on one text (float32, CPU). ``q`` rows are query positions, ``k``/``v`` rows keys."""

    layer: int
    head: int
    kv_head: int
    pattern: Tensor  # (q, k) softmax weights: what the model uses
    scores: Tensor  # (q, k) q·kᵀ·scale, soft-capped, plus the family's score terms; before the mask
    q: Tensor  # (q, D)
    k: Tensor  # (k, D) the head's KV head's keys
    v: Tensor  # (k, D)
    output: Tensor  # (q, D) pattern @ v: what the head writes before W_O


@dataclass
class LayerMaps:
    """One layer's tensors: per query head for pattern, scores, q and output; per KV head for k and v."""

    layer: int
    kv_groups: int
    pattern: Tensor  # (H, q, k)
    scores: Tensor  # (H, q, k)
    q: Tensor  # (H, q, D)
    k: Tensor  # (Hkv, k, D)
    v: Tensor  # (Hkv, k, D)
    output: Tensor  # (H, q, D)

    def head(self, head: int) -> HeadMaps:
        kv_head = head // self.kv_groups
        per_head = {name: getattr(self, name)[head] for name in ("pattern", "scores", "q", "output")}
        return HeadMaps(layer=self.layer, head=head, kv_head=kv_head, k=self.k[kv_head], v=self.v[kv_head], **per_head)


@dataclass
class AttentionCache:
    """Every captured layer of one text, by name: ``cache["L3H1"]``, ``cache["pattern", 3]``, ``cache[3]``."""

    model: str
    text: str
    tokens: list[Token]
    layers: dict[int, LayerMaps]
    num_heads: int
    logits: Tensor | None = field(default=None, repr=False)  # (T, V) the model's output, for a language model

    def __getitem__(self, key: str | int | tuple[str, int]) -> HeadMaps | LayerMaps | Tensor:
        if isinstance(key, int):
            return self._layer(key)
        if isinstance(key, tuple):
            name, layer = key
            if name not in CACHE_FIELDS:
                raise KeyError(f"{name!r} is not a cached field; valid: {', '.join(CACHE_FIELDS)}")
            return getattr(self._layer(layer), name)
        found = _HEAD_LABEL.match(key.strip())
        if found is None:
            raise KeyError(f"{key!r} is not a head label: write 'L<layer>H<head>', e.g. 'L{min(self.layers)}H0'")
        head = int(found.group(2))
        if head >= self.num_heads:
            raise KeyError(f"head {head} out of range 0..{self.num_heads - 1}")
        return self._layer(int(found.group(1))).head(head)

    def _layer(self, layer: int) -> LayerMaps:
        if layer not in self.layers:
            raise KeyError(f"layer {layer} was not captured; captured: {sorted(self.layers)}")
        return self.layers[layer]

    def heads(self) -> list[str]:
        """Every head label in the cache, layer by layer."""
        return [f"L{layer}H{head}" for layer in sorted(self.layers) for head in range(self.num_heads)]


class _Keep:
    """Copies every chunk of every captured layer to the CPU in float32 (the cache's one consumer)."""

    accepts_key_prefix: ClassVar[bool] = False  # the cache holds every key column

    def __init__(self) -> None:
        self.parts: dict[int, dict[str, list[Tensor]]] = {}
        self.kv: dict[int, tuple[Tensor, Tensor, int]] = {}

    def on_layer(self, layer: LayerAttention) -> None:
        def cpu(tensor: Tensor) -> Tensor:
            return tensor[0].detach().to("cpu", torch.float32).clone()

        parts = self.parts.setdefault(layer.layer, {"pattern": [], "scores": [], "q": [], "output": []})
        parts["pattern"].append(cpu(layer.weights))
        parts["scores"].append(cpu(layer.scores))
        parts["q"].append(cpu(layer.query))
        output = layer.output if layer.output is not None else layer.weights @ layer.head_key(layer.value)
        parts["output"].append(cpu(output))
        if layer.layer not in self.kv:
            self.kv[layer.layer] = (cpu(layer.key), cpu(layer.value), layer.kv_groups)

    def layer_maps(self, layer: int) -> LayerMaps:
        parts = {name: torch.cat(chunks, dim=1) for name, chunks in self.parts[layer].items()}  # rows: dim 1
        key, value, groups = self.kv[layer]
        return LayerMaps(layer=layer, kv_groups=groups, k=key, v=value, **parts)


def cache_bytes(stack: StackFacts, rows: int, keys: int, layers: int) -> int:
    """Bytes a cache of ``layers`` layers holds in float32: pattern and scores (H·q·k each), q (H·q·d_qk), output
    (H·q·D), k (Hkv·k·d_qk) and v (Hkv·k·D)."""
    heads, kv_heads, qk, width = stack.num_heads, stack.num_kv_heads, stack.qk_dim, stack.head_dim
    per_layer = 2 * heads * rows * keys + heads * rows * (qk + width) + kv_heads * keys * (qk + width)
    return per_layer * layers * _FLOAT32


def capture_maps(
    model: str | LoadedModel | None,
    text: str,
    *,
    layers: Sequence[int] | None = None,
    attention: str | None = None,
    inspector: Inspector | None = None,
) -> AttentionCache:
    """Capture every map of ``text`` (all layers, or ``layers``) into an :class:`AttentionCache`.

    Args:
        model: a bundled alias, a local folder or .gguf file, a registered name, a :class:`LoadedModel`, or None
            for the default model.
        text: the text, tokenised as the tools tokenise it (the model's special tokens added).
        layers: the layers to keep (default: every layer of the stack).
        attention: the stack of an encoder–decoder ("encoder", "decoder", "cross"); None: the model's default.
        inspector: the session whose model cache and memory budget apply (default: a new one).

    Raises:
        ResourceLimitError: when the cache would exceed the session's memory budget (the message names the
            streaming way for long texts).
        InvalidInputError: a layer out of range or an unknown stack.
    """
    session = inspector or Inspector()
    loaded = model if isinstance(model, LoadedModel) else session.model(model)
    stack = session.attention_stack(loaded, attention)
    wanted = session.check_layers(loaded, layers, stack, "layers")
    encoded = session.encode_on(loaded, text, stack)
    rows, keys = len(encoded.query_tokens), len(encoded.key_tokens)
    held = cache_bytes(stack, rows, keys, len(wanted))
    if held > session.memory_budget:
        msg = (
            f"a cache of {len(wanted)} layers × {stack.num_heads} heads on {keys} tokens would hold "
            f"{held / 2**20:.0f} MiB, over the budget of {session.memory_budget / 2**20:.0f} MiB: pass fewer `layers` "
            "or a shorter text; for long texts stream a consumer through agent_tools.capture.capture_attention "
            "(agent_tools/consumers/ has one per statistic) or call the tools, which never hold maps"
        )
        raise ResourceLimitError(msg)
    keep = _Keep()
    output = session.run(loaded, encoded, [keep], layers=wanted)
    logits = getattr(output, "logits", None)
    missing = [layer for layer in wanted if layer not in keep.parts]
    if missing:
        raise InvalidInputError(f"layers {missing} were not reached by the pass", field="layers")
    return AttentionCache(
        model=loaded.name,
        text=text,
        tokens=list(encoded.key_tokens),
        layers={layer: keep.layer_maps(layer) for layer in wanted},
        num_heads=stack.num_heads,
        logits=None if logits is None else logits[0].detach().to("cpu", torch.float32),
    )
