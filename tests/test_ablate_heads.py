"""Head ablation: pure metrics by hand, exact no-ops, whole-layer = no attention output, the model restored."""

from __future__ import annotations

import math

import pytest
import torch
from crafted import circuit_tokenizer, induction_circuit
from families import build_family, tiny_tokenizer

from agent_tools.analysis.ablation import cosine_change, masked_mean, replace_head_slices
from agent_tools.analysis.metrics import kl_divergence as next_token_kl
from agent_tools.analysis.metrics import next_token_losses as token_losses
from agent_tools.errors import InvalidInputError
from agent_tools.families import find_attention_modules
from agent_tools.inspector import Inspector
from agent_tools.intervene import heads_ablated, recorded_head_means
from agent_tools.layout import output_projection
from agent_tools.loading import register_model
from agent_tools.tools import get_tool
from agent_tools.tools.ablate_heads import parse_heads

TEXT = "the cat sat on the mat because it was tired"


# --- pure metrics -----------------------------------------------------------------------------------------------


def test_kl_loss_cosine_by_hand() -> None:
    clean = torch.tensor([[0.0, 0.0]])  # p = (1/2, 1/2)
    ablated = torch.tensor([[math.log(3.0), 0.0]])  # q = (3/4, 1/4)
    assert next_token_kl(clean, ablated).item() == pytest.approx(0.5 * math.log(4 / 3))
    assert next_token_kl(clean, clean).item() == 0.0
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]]))
    losses = token_losses(logits, torch.tensor([[0, 1, 2]]))
    assert losses[0].tolist() == pytest.approx([math.log(4), -math.log(0.8)])
    assert cosine_change(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])).item() == pytest.approx(1.0)
    assert cosine_change(torch.tensor([1.0, 1.0]), torch.tensor([2.0, 2.0])).item() == pytest.approx(0.0, abs=1e-12)


def test_replace_head_slices_is_pure_and_exact() -> None:
    hidden = torch.arange(12.0).reshape(1, 2, 6)  # (B, T, H·D) with H = 3, D = 2
    zeroed = replace_head_slices(hidden, [1], 2)
    assert zeroed.tolist() == [[[0, 1, 0, 0, 4, 5], [6, 7, 0, 0, 10, 11]]]
    means = torch.tensor([[-1.0, -1.0], [-2.0, -3.0], [-4.0, -4.0]])  # (H, D)
    meaned = replace_head_slices(hidden, [0, 2], 2, means)
    assert meaned.tolist() == [[[-1, -1, 2, 3, -4, -4], [-1, -1, 8, 9, -4, -4]]]
    assert hidden.tolist() == torch.arange(12.0).reshape(1, 2, 6).tolist()  # input untouched
    mask = torch.tensor([[1, 0]])
    assert masked_mean(hidden, mask).tolist() == [0, 1, 2, 3, 4, 5]
    assert masked_mean(hidden).tolist() == [3, 4, 5, 6, 7, 8]


def test_parse_heads_forms_and_errors() -> None:
    assert parse_heads(["3.0", "L2H5", {"layer": 1, "head": 1}, " 0:2 "], 4, 6) == [(3, 0), (2, 5), (1, 1), (0, 2)]
    assert parse_heads(["2.*", "0.1"], 4, 3) == [(2, 0), (2, 1), (2, 2), (0, 1)]
    with pytest.raises(InvalidInputError, match=r"heads\[0\] layer 4 out of range 0\.\.3"):
        parse_heads(["4.0"], 4, 6)
    with pytest.raises(InvalidInputError, match=r"heads\[1\] head 6 out of range 0\.\.5"):
        parse_heads(["0.0", "0.6"], 4, 6)
    with pytest.raises(InvalidInputError, match=r"out of range 0\.\.3"):
        parse_heads(["-1.0"], 4, 6)
    with pytest.raises(InvalidInputError, match=r'write "L\.H"'):
        parse_heads(["head three"], 4, 6)
    with pytest.raises(InvalidInputError, match=r"1\.1 more than once"):
        parse_heads(["1.1", {"layer": 1, "head": 1}], 4, 6)
    with pytest.raises(InvalidInputError, match=r"1\.0 more than once"):
        parse_heads(["1.*", "1.0"], 4, 6)
    with pytest.raises(InvalidInputError, match=r"heads\[0\] layer 9 out of range 0\.\.3"):
        parse_heads(["9.*"], 4, 6)


# --- interventions on tiny models -------------------------------------------------------------------------------


def _ids() -> torch.Tensor:
    return torch.tensor([[0, 6, 8, 10, 11, 6, 12, 13, 14, 15, 16]])


def _output(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


class ZeroAttentionOutput:
    """Reference: a forward hook that replaces the attention module's output (or a constant) — no head slicing."""

    def __init__(self, module: torch.nn.Module, fill: torch.Tensor | None = None) -> None:
        self.handle = module.register_forward_hook(self.hook)
        self.fill = fill

    def hook(self, module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        replaced = torch.zeros_like(first) if self.fill is None else self.fill.expand_as(first).clone()
        return (replaced, *output[1:]) if isinstance(output, tuple) else replaced


@pytest.mark.parametrize("family", ["llama", "bert", "gpt2", "gpt_neox", "opt", "phi3"])
def test_ablating_every_head_of_a_layer_removes_the_attention_output(family: str) -> None:
    model = build_family(family)
    config = model.config
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    ids = _ids()
    with heads_ablated(model, {1: list(range(heads))}, num_heads=heads, head_dim=head_dim):
        ablated = _output(model, ids)
    attention = find_attention_modules(model)[1]
    projection = output_projection(model, 1)
    bias = getattr(projection, "bias", None)
    # BERT's projection sits outside the self-attention module, so zeroing the module's output leaves dense(0) =
    # bias, exactly what head ablation leaves; elsewhere the projection is inside and its bias survives ablation.
    inside = any(child is projection for child in attention.children())
    fill = bias.detach() if inside and bias is not None else None
    reference = ZeroAttentionOutput(attention, fill)
    try:
        removed = _output(model, ids)
    finally:
        reference.handle.remove()
    assert torch.allclose(ablated, removed, atol=1e-6), (ablated - removed).abs().max()
    assert not torch.allclose(ablated, _output(model, ids), atol=1e-4)  # and it did change the output


def test_mean_ablation_sets_the_slice_to_the_recorded_mean_and_unhooks() -> None:
    model = build_family("llama")
    ids = _ids()
    with recorded_head_means(model, [0], num_heads=4, head_dim=8) as means:
        clean = _output(model, ids)
    assert means[0].shape == (4, 8)
    projection = output_projection(model, 0)
    recorded: list[torch.Tensor] = []
    with heads_ablated(model, {0: [2]}, num_heads=4, head_dim=8, method="mean", means=means):
        # registered after the ablation hook, so it sees what the projection receives
        handle = projection.register_forward_pre_hook(lambda m, args: recorded.append(args[0].clone()))
        try:
            _output(model, ids)
        finally:
            handle.remove()
    slice_ = recorded[0][0, :, 16:24]  # head 2's slice at every position = its mean over the clean positions
    assert torch.allclose(slice_, means[0][2].expand_as(slice_))
    assert torch.equal(_output(model, ids), clean)


@pytest.fixture(scope="module")
def zero_slice_model() -> str:
    """tiny llama whose layer-1 head 2 has an all-zero output-projection slice: it writes nothing."""
    model = build_family("llama", seed=3)
    with torch.no_grad():
        output_projection(model, 1).weight[:, 16:24] = 0
    register_model("tiny-llama-silent-head", model, tiny_tokenizer())
    return "tiny-llama-silent-head"


def test_a_head_with_a_zero_output_slice_changes_nothing(zero_slice_model, inspector: Inspector) -> None:
    for method in ("zero", "mean"):
        report = get_tool("ablate_heads")(
            inspector, {"model": zero_slice_model, "text": TEXT, "heads": ["1.2"], "method": method}
        )
        assert report.kl_last_position == 0 and report.kl_mean == 0 and report.loss_change == 0
        assert report.top_token_changed is False and report.top_token_clean == report.top_token_ablated
        assert report.measure == "next_token" and report.heads == ["1.2"]


def test_tool_restores_the_model_exactly(tiny_models, inspector: Inspector) -> None:
    model = tiny_models["llama"].model
    ids = _ids()
    before = _output(model, ids)
    report = get_tool("ablate_heads")(
        inspector, {"model": "tiny-llama", "text": TEXT, "heads": ["0.0", {"layer": 1, "head": 3}], "method": "mean"}
    )
    assert report.kl_mean is not None and report.kl_mean > 0
    assert report.loss_clean is not None and report.loss_ablated is not None
    assert report.loss_change == pytest.approx(report.loss_ablated - report.loss_clean, abs=1e-3)
    assert report.top_token_clean and report.top_token_ablated and len(report.largest_effects) == 5
    with pytest.raises(InvalidInputError, match=r"out of range 0\.\.1"):
        get_tool("ablate_heads")(inspector, {"model": "tiny-llama", "text": TEXT, "heads": ["2.0"]})
    with pytest.raises(InvalidInputError, match="heads"):
        get_tool("ablate_heads")(inspector, {"model": "tiny-llama", "text": TEXT, "heads": []})
    after = _output(model, ids)
    assert torch.equal(before, after)
    for layer in range(2):
        assert not output_projection(model, layer)._forward_pre_hooks
    assert model.config._attn_implementation == "eager"  # ablation never switched implementations


def test_encoder_reports_the_pooled_embedding_change(tiny_models, inspector: Inspector) -> None:
    report = get_tool("ablate_heads")(inspector, {"model": "tiny-bert", "text": TEXT, "heads": ["0.1", "1.0"]})
    assert report.measure == "embedding" and report.kl_mean is None
    assert report.pooled_cosine_change is not None and report.pooled_cosine_change > 0
    assert report.mean_token_cosine_change is not None and report.mean_token_cosine_change > 0


@pytest.mark.real_model
def test_default_model_ablation(smol, inspector: Inspector) -> None:
    text = "The cat sat on the mat because it was tired. The cat sat on the"
    before = _output(smol.model, torch.tensor([[1, 2, 3]]))
    report = get_tool("ablate_heads")(inspector, {"text": text, "heads": ["18.6", "17.4", "17.3"]})
    assert report.kl_mean is not None and report.kl_mean > 0 and report.loss_change is not None
    assert torch.equal(before, _output(smol.model, torch.tensor([[1, 2, 3]])))
    assert smol.model.config._attn_implementation == "sdpa"


# --- direct logit attribution ------------------------------------------------------------------------------------


def test_direct_logit_attribution_on_the_known_circuit(inspector: Inspector) -> None:
    register_model("circuit-dla", induction_circuit(), circuit_tokenizer())
    report = get_tool("ablate_heads")(
        inspector, {"model": "circuit-dla", "text": "cat dog sun moon cat", "heads": ["1.0"]}
    )
    dla = report.direct_logit_attribution
    assert dla is not None and dla.token == "dog" and dla.final_norm == "layer_norm"
    # only the induction head writes into the subspace the unembedding reads: it alone is the logit
    assert dla.top_heads[0].layer == 1 and dla.top_heads[0].head == 0
    assert dla.top_heads[0].logit == pytest.approx(dla.logit, abs=1e-4)
    assert all(h.logit == pytest.approx(0.0, abs=1e-6) for h in dla.top_heads[1:])
    assert dla.heads_total == pytest.approx(dla.logit, abs=1e-4) and dla.layers[0] == pytest.approx(0.0, abs=1e-6)
    assert [(h.layer, h.head) for h in dla.ablated] == [(1, 0)] and "frozen" in report.summary
    # removing it breaks the copy: the clean answer is no longer the top token
    assert report.top_token_clean == "dog" and report.top_token_changed
    assert [c.tool for c in report.next_calls] == ["profile_heads"]


def test_direct_logit_attribution_target_and_bad_target(tiny_models, inspector: Inspector) -> None:
    args = {"model": "tiny-llama", "text": TEXT, "heads": ["0.1"], "target_token": "mat"}
    dla = get_tool("ablate_heads")(inspector, args).direct_logit_attribution
    assert dla is not None and dla.token == "mat" and dla.final_norm == "rms_norm"
    with pytest.raises(InvalidInputError, match=r"target_token 'the cat' is 2 tokens \(\['the', 'cat'\]\)"):
        get_tool("ablate_heads")(inspector, {**args, "target_token": "the cat"})
    encoder = get_tool("ablate_heads")(inspector, {"model": "tiny-bert", "text": TEXT, "heads": ["0.1"]})
    assert encoder.direct_logit_attribution is None
