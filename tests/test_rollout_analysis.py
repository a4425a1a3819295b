"""Rollout: hand-computed on a 2-token, 2-layer case; rows sum to 1; streaming equals the batch formula."""

from __future__ import annotations

import torch
from families import build_family

from agent_tools.analysis.rollout import attention_rollout, residual_mix
from agent_tools.capture import capture_attention
from agent_tools.consumers.rollout import RolloutConsumer


def test_hand_computed_two_layers() -> None:
    a1 = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    a2 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    # Â1 = [[1, 0], [.25, .75]], Â2 = [[1, 0], [.5, .5]]; R = Â2 Â1 = [[1, 0], [.625, .375]]
    expected = torch.tensor([[1.0, 0.0], [0.625, 0.375]])
    assert torch.allclose(attention_rollout([a1, a2]), expected)
    assert torch.allclose(residual_mix(a1), torch.tensor([[1.0, 0.0], [0.25, 0.75]]))


def test_streaming_rollout_matches_and_rows_sum_to_one() -> None:
    model = build_family("llama")
    ids = torch.arange(6, 16)[None]
    streamed, chunked = RolloutConsumer(), RolloutConsumer()
    maps: list[torch.Tensor] = []

    class Keep:
        accepts_key_prefix = False

        def on_layer(self, layer) -> None:
            maps.append(layer.weights[0].mean(0))

    with torch.inference_mode():
        with capture_attention(model, [streamed, Keep()]):
            model(input_ids=ids)
        with capture_attention(model, [chunked], query_chunk=3):
            model(input_ids=ids)
    rollout = streamed.rollout()
    assert torch.allclose(rollout, attention_rollout(maps), atol=1e-6)
    assert torch.allclose(chunked.rollout(), rollout, atol=1e-6)
    assert torch.allclose(rollout.sum(-1), torch.ones(10), atol=1e-5)
    assert rollout.triu(1).abs().max() == 0  # causal model: nothing flows from the future
