"""capture_maps: a named cache of a short text's maps equals the model's own eager attention, head by head."""

from __future__ import annotations

import pytest
import torch
from reference import ATOL, SAMPLE_TEXT, eager_reference

from agent_tools.attention_cache import CACHE_FIELDS, cache_bytes, capture_maps
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Inspector


def test_every_head_equals_the_models_eager_attention(tiny_models, inspector: Inspector) -> None:
    loaded = tiny_models["llama"]
    cache = capture_maps(loaded, SAMPLE_TEXT, inspector=inspector)
    encoded = inspector.encode(loaded, SAMPLE_TEXT)
    reference = eager_reference(loaded.model, input_ids=encoded.input_ids, attention_mask=encoded.attention_mask)
    facts = loaded.facts
    assert sorted(cache.layers) == list(range(facts.num_layers))
    assert len(cache.heads()) == facts.num_layers * facts.num_heads
    for layer, expected in enumerate(reference.attentions):
        assert torch.allclose(cache["pattern", layer], expected[0].float(), atol=ATOL)
        for head in range(facts.num_heads):
            maps = cache[f"L{layer}H{head}"]
            assert torch.equal(maps.pattern, cache["pattern", layer][head])
            # the pattern is the causal softmax of the cached scores, and the output is pattern @ v
            allowed = torch.ones_like(maps.scores, dtype=torch.bool).tril()
            rebuilt = torch.softmax(maps.scores.masked_fill(~allowed, float("-inf")), dim=-1)
            assert torch.allclose(rebuilt, maps.pattern, atol=ATOL)
            assert torch.allclose(maps.pattern @ maps.v, maps.output, atol=ATOL)
            assert maps.kv_head == head // (facts.num_heads // facts.num_kv_heads)
    assert cache.logits is not None and torch.allclose(cache.logits, reference.logits[0], atol=1e-4)
    # the maps are peaked enough that a wrong head or layer would show
    assert max(float(cache["pattern", layer].max()) for layer in cache.layers) > 0.5


def test_a_subset_of_layers_and_the_names_that_are_not_there(tiny_models, inspector: Inspector) -> None:
    cache = capture_maps(tiny_models["llama"], SAMPLE_TEXT, layers=[1], inspector=inspector)
    assert list(cache.layers) == [1]
    assert cache[1].pattern.shape[0] == cache.num_heads
    with pytest.raises(KeyError, match=r"layer 0 was not captured; captured: \[1\]"):
        cache["L0H0"]
    with pytest.raises(KeyError, match="out of range"):
        cache[f"L1H{cache.num_heads}"]
    with pytest.raises(KeyError, match="L<layer>H<head>"):
        cache["18,6"]
    with pytest.raises(KeyError, match="valid: " + ", ".join(CACHE_FIELDS)):
        cache["attn", 1]
    with pytest.raises(InvalidInputError, match="out of range"):
        capture_maps(tiny_models["llama"], SAMPLE_TEXT, layers=[99], inspector=inspector)


def test_a_cache_over_the_budget_is_refused_before_the_pass(tiny_models, tmp_path) -> None:
    loaded = tiny_models["llama"]
    small = Inspector(artifact_dir=tmp_path, memory_budget=10_000)
    tokens = len(small.encode(loaded, SAMPLE_TEXT).tokens)
    stack = small.attention_stack(loaded, None)
    needed = cache_bytes(stack, tokens, tokens, stack.num_layers)
    h, hkv, qk, d = stack.num_heads, stack.num_kv_heads, stack.qk_dim, stack.head_dim
    assert needed == 4 * stack.num_layers * (2 * h * tokens**2 + h * tokens * (qk + d) + hkv * tokens * (qk + d))
    with pytest.raises(ResourceLimitError, match="capture_attention"):
        capture_maps(loaded, SAMPLE_TEXT, inspector=small)
