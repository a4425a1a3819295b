"""attention_rollout tool: the row equals the pure rollout of the captured maps, sums to 1, respects causality."""

from __future__ import annotations

import pytest
import torch

from agent_tools.analysis.rollout import attention_rollout
from agent_tools.capture import capture_attention
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.tools import get_tool
from agent_tools.tools.attention_rollout import RolloutReport

TEXT = "the cat sat on the mat because it was tired"


def _head_means(loaded, text: str, inspector: Inspector) -> list[torch.Tensor]:
    encoded = inspector.encode(loaded, text)
    maps: list[torch.Tensor] = []

    class Keep:
        accepts_key_prefix = False

        def on_layer(self, layer) -> None:
            maps.append(layer.weights[0].float().mean(0).clone())

    with torch.inference_mode(), capture_attention(loaded.model, [Keep()]):
        loaded.model(input_ids=encoded.input_ids, attention_mask=encoded.attention_mask)
    return maps


@pytest.mark.parametrize("family", ["llama", "bert", "gpt2"])
def test_rollout_row_matches_the_pure_function_and_sums_to_one(tiny_models, inspector: Inspector, family) -> None:
    loaded = tiny_models[family]
    report = get_tool("attention_rollout")(inspector, {"model": f"tiny-{family}", "text": TEXT, "residual": 0.4})
    assert isinstance(report, RolloutReport)
    length = len(report.sources)
    assert length == 11 and report.layers == 2
    expected = attention_rollout(_head_means(loaded, TEXT, inspector), residual=0.4)[report.position]
    shares = torch.tensor([s.share for s in report.sources])
    assert torch.allclose(shares, expected, atol=1e-6)
    assert shares.sum().item() == pytest.approx(1.0, abs=1e-5) and report.total == pytest.approx(1.0, abs=1e-6)
    if family == "bert":
        assert report.position == 0  # encoders default to the first ([CLS]-like) token
    else:
        assert report.position == length - 1  # decoders default to the last token
    assert report.top_sources[0].share == max(s.share for s in report.sources)
    raw = torch.tensor([s.last_layer_attention for s in report.sources])
    assert raw.sum().item() == pytest.approx(1.0, abs=1e-5)


def test_position_layers_and_causality(tiny_models, inspector: Inspector) -> None:
    tool = get_tool("attention_rollout")
    report = tool(inspector, {"model": "tiny-llama", "text": TEXT, "position": -4, "up_to_layer": 0})
    assert report.position == 7 and report.token == "because" and report.layers == 1
    assert all(s.share == 0 for s in report.sources if s.position > 7)  # nothing flows from the future
    # one layer: Â = 0.5·I + 0.5·Ā, so the target keeps at least half of itself
    assert report.sources[7].share >= 0.5
    expected = attention_rollout(_head_means(tiny_models["llama"], TEXT, inspector)[:1])[7]
    assert torch.allclose(torch.tensor([s.share for s in report.sources]), expected, atol=1e-6)
    with pytest.raises(InvalidInputError, match=r"position 11 out of range 0\.\.10"):
        tool(inspector, {"model": "tiny-llama", "text": TEXT, "position": 11})
    with pytest.raises(InvalidInputError, match=r"layer 2 out of range 0\.\.1"):
        tool(inspector, {"model": "tiny-llama", "text": TEXT, "up_to_layer": 2})
    with pytest.raises(InvalidInputError, match="residual"):
        tool(inspector, {"model": "tiny-llama", "text": TEXT, "residual": 1.0})


@pytest.mark.real_model
def test_rollout_on_the_default_model(smol, inspector: Inspector) -> None:
    report = get_tool("attention_rollout")(inspector, {"text": "The cat sat on the mat because it was tired."})
    assert report.layers == 30 and report.total == pytest.approx(1.0, abs=1e-5)
    assert report.position == len(report.sources) - 1 and "rollout" in report.summary.lower()
