"""Exactness on the two real bundled models, every layer and head."""

from __future__ import annotations

import pytest
import torch
from reference import ATOL, SAMPLE_TEXT, KeepAll, eager_reference, output_tensor, rebuild

from agent_tools.capture import capture_attention
from agent_tools.loading import LoadedModel

pytestmark = pytest.mark.real_model


def _check_parity(loaded: LoadedModel, **inputs: torch.Tensor) -> None:
    reference = eager_reference(loaded.model, **inputs)
    keep = KeepAll()
    with torch.inference_mode(), capture_attention(loaded.model, [keep]):
        captured = loaded.model(**inputs)
    assert len(keep.layers) == loaded.facts.num_layers == len(reference.attentions)
    worst = 0.0
    for index, expected in enumerate(reference.attentions):
        got = keep.weights(index)
        assert got.shape[1] == loaded.facts.num_heads
        worst = max(worst, (got - expected).abs().max().item())
        assert (rebuild(keep.layers[index]) - got).abs().max().item() <= ATOL
    assert worst <= ATOL
    assert (output_tensor(captured) - output_tensor(reference)).abs().max().item() <= ATOL


def test_smollm2_capture_is_exact(smol: LoadedModel) -> None:
    encoded = smol.tokenizer(SAMPLE_TEXT, return_tensors="pt")
    _check_parity(smol, input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"])
    assert smol.facts.num_kv_heads == 3 and smol.facts.head_dim == 64 and smol.facts.num_layers == 30


def test_minilm_capture_is_exact(minilm: LoadedModel) -> None:
    encoded = minilm.tokenizer(SAMPLE_TEXT, return_tensors="pt")
    _check_parity(minilm, input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"])
    assert minilm.facts.num_heads == 12 and minilm.facts.head_dim == 32 and not minilm.facts.is_causal


def test_smollm2_left_padded_batch_equals_alone(smol: LoadedModel) -> None:
    tokenizer = smol.tokenizer
    texts = [SAMPLE_TEXT, "Paris is the capital of"]
    singles = [tokenizer(t, return_tensors="pt")["input_ids"] for t in texts]
    width = max(s.shape[1] for s in singles)
    pad = tokenizer.pad_token_id
    ids = torch.stack([torch.cat([torch.full((width - s.shape[1],), pad), s[0]]) for s in singles])
    mask = torch.stack([torch.cat([torch.zeros(width - s.shape[1]), torch.ones(s.shape[1])]) for s in singles]).long()
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.inference_mode():
        batch = smol.model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
        for row, single in enumerate(singles):
            alone = smol.model(input_ids=single).logits[0]
            assert (batch[row, width - single.shape[1] :] - alone).abs().max().item() <= 1e-4
