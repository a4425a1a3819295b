"""Attention stacks: encoder, decoder and cross-attention of encoder–decoders through every per-layer tool.

Tiny random-weight BART and T5 (encoder 2 layers, decoder 3, so the depths differ) with peaked maps, checked
against the models' own eager ``encoder_attentions`` / ``decoder_attentions`` / ``cross_attentions``.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from families import VOCAB, build_family, tiny_tokenizer

from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel, register_model
from agent_tools.tools import TOOLS

TEXT = "the cat sat on the mat because it was tired ."
OUTPUTS = {"encoder": "encoder_attentions", "decoder": "decoder_attentions", "cross": "cross_attentions"}


def _peaked(model: torch.nn.Module, names: tuple[str, ...], factor: float) -> torch.nn.Module:
    """Scale the q/k projections so rows are far from uniform (BART's init is 30× gentler than T5's)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2 and name.rsplit(".", 2)[-2] in names:
                param.mul_(factor)
    return model.eval()


def _bart(decoder_heads: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=decoder_heads, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=1, pad_token_id=3, decoder_start_token_id=0, forced_bos_token_id=None,
        forced_eos_token_id=None,
    )  # fmt: skip
    model = tf.BartForConditionalGeneration._from_config(config, attn_implementation="eager")
    return _peaked(model, ("q_proj", "k_proj"), 30.0)


def _t5() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=3, eos_token_id=1,
        decoder_start_token_id=0,
    )  # fmt: skip
    model = tf.T5ForConditionalGeneration._from_config(config, attn_implementation="eager")
    return _peaked(model, ("q", "k"), 3.0)


@pytest.fixture(scope="module")
def seq2seq() -> dict[str, LoadedModel]:
    tokenizer = tiny_tokenizer()
    return {
        name: register_model(f"tiny-stack-{name}", build(), tokenizer) for name, build in [("bart", _bart), ("t5", _t5)]
    }


@pytest.fixture(scope="module")
def gpt2() -> LoadedModel:
    return register_model("tiny-stack-gpt2", build_family("gpt2"), tiny_tokenizer())


def _eager(loaded: LoadedModel, inspector: Inspector, stack: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The model's own attentions of ``stack`` on TEXT, with the decoder reading the model's greedy answer."""
    encoded = inspector.encode_on(loaded, TEXT, loaded.facts.stack(stack))
    decoder = inspector.on_stack(loaded, encoded, loaded.facts.stack("cross")).decoder
    assert decoder is not None
    with torch.no_grad():
        out = loaded.model(
            input_ids=encoded.input_ids,
            attention_mask=encoded.attention_mask,
            decoder_input_ids=decoder.input_ids,
            output_attentions=True,
        )
    return list(getattr(out, OUTPUTS[stack])), decoder.input_ids


@pytest.mark.parametrize("family", ["bart", "t5"])
@pytest.mark.parametrize("stack", ["encoder", "decoder", "cross"])
def test_show_attention_equals_the_models_own_attentions(seq2seq, inspector, family, stack):
    loaded = seq2seq[family]
    reference, decoder_ids = _eager(loaded, inspector, stack)
    layers = loaded.facts.stack(stack).num_layers
    assert len(reference) == layers == (2 if stack == "encoder" else 3)
    for layer in range(layers):
        report = TOOLS["show_attention"](
            inspector,
            {"model": loaded.name, "text": TEXT, "layer": layer, "head": 1, "attention": stack, "include_map": True},
        )
        expected = reference[layer][0, 1]  # (q, Tk)
        assert report.attention == stack
        got = torch.tensor(report.weights)
        assert got.shape == expected.shape
        assert float((got - expected).abs().max()) < 1e-5
        assert float(expected.max(-1).values.mean()) > 0.4  # peaked rows: an error would show
    if stack == "cross":  # rows: the decoder's tokens (start + answer); columns: the input's
        assert got.shape == (decoder_ids.shape[-1], len(inspector.encode(loaded, TEXT).tokens))


CALLS = {
    "show_attention": {"layer": 1, "head": 0},
    "diagnose_collapse": {},
    "explain_scaling": {"layer": 0},
    "inspect_projections": {"layer": 1, "head": 3},
    "reconstruct_attention": {"layer": 1, "head": 2},
    "profile_heads": {"roles": ["previous_token", "first_token"], "ablate_top": 0},
    "attention_rollout": {},
    "ablate_heads": {"heads": ["1.2"]},
}
VALID = {
    "show_attention": ("encoder", "decoder", "cross"),
    "diagnose_collapse": ("encoder", "decoder", "cross"),
    "explain_scaling": ("encoder", "decoder", "cross"),
    "inspect_projections": ("encoder", "decoder"),
    "reconstruct_attention": ("encoder", "decoder"),
    "profile_heads": ("encoder",),
    "attention_rollout": ("encoder", "decoder"),
    "ablate_heads": ("encoder",),
}


@pytest.mark.parametrize("tool", list(CALLS))
def test_every_per_layer_tool_runs_on_its_stacks_and_refuses_the_others(seq2seq, inspector, tool):
    loaded = seq2seq["t5"]
    for stack in (None, "encoder", "decoder", "cross"):
        arguments = {"model": loaded.name, "text": TEXT, **CALLS[tool], "attention": stack}
        if stack is not None and stack not in VALID[tool]:
            with pytest.raises(InvalidInputError) as refused:
                TOOLS[tool](inspector, arguments)
            assert refused.value.field == "attention"
            assert repr(stack) in refused.value.message
            continue
        report = TOOLS[tool](inspector, arguments)
        assert report.attention == (stack or "encoder")
        assert report.summary.startswith("On the " + ("encoder" if stack in (None, "encoder") else stack))


def test_patch_heads_takes_only_a_single_stack(seq2seq, inspector):
    arguments = {"model": seq2seq["bart"].name, "clean": "the cat sat", "corrupted": "the dog sat"}
    with pytest.raises(InvalidInputError, match="none of the stacks"):
        TOOLS["patch_heads"](inspector, arguments)


def test_bad_stacks_and_layers_name_what_is_valid(seq2seq, gpt2, inspector):
    bart = seq2seq["bart"].name
    with pytest.raises(InvalidInputError, match=r"no 'self' attention.*\['encoder', 'decoder', 'cross'\]"):
        TOOLS["show_attention"](inspector, {"model": bart, "text": TEXT, "layer": 0, "head": 0, "attention": "self"})
    with pytest.raises(InvalidInputError, match=r"no 'cross' attention.*\['self'\]"):
        TOOLS["diagnose_collapse"](inspector, {"model": gpt2.name, "text": TEXT, "attention": "cross"})
    with pytest.raises(InvalidInputError, match=r"no 'cross' attention.*\['self'\]"):
        TOOLS["trace_prompt_attention"](inspector, {"model": gpt2.name, "prompt": TEXT, "attention": "cross"})
    with pytest.raises(InvalidInputError, match="Input should be 'self', 'encoder', 'decoder' or 'cross'"):
        TOOLS["diagnose_collapse"](inspector, {"model": bart, "text": TEXT, "attention": "decoders"})
    # the decoder has 3 layers, the encoder 2: layer 2 is valid on one and out of range on the other
    TOOLS["show_attention"](inspector, {"model": bart, "text": TEXT, "layer": 2, "head": 0, "attention": "decoder"})
    with pytest.raises(InvalidInputError, match=r"layer 2 out of range 0\.\.1 of the encoder stack") as error:
        TOOLS["show_attention"](inspector, {"model": bart, "text": TEXT, "layer": 2, "head": 0})
    assert error.value.field == "layer"
    with pytest.raises(
        InvalidInputError, match=r"layers lists .*0\.\.2 of the cross stack|out of range 0\.\.2 of the cross"
    ):
        TOOLS["diagnose_collapse"](inspector, {"model": bart, "text": TEXT, "layers": [3], "attention": "cross"})
    # a model with no next-token head cannot answer, so its decoder has nothing to read
    headless = register_model(
        "tiny-stack-bart-headless", tf.BartModel(seq2seq["bart"].model.config).eval(), tiny_tokenizer()
    )
    with pytest.raises(InvalidInputError, match=r"no next-token head.*use attention='encoder'"):
        TOOLS["show_attention"](
            inspector, {"model": headless.name, "text": TEXT, "layer": 0, "head": 0, "attention": "cross"}
        )


def test_describe_model_lists_the_stacks(seq2seq, gpt2, inspector):
    t5 = TOOLS["describe_model"](inspector, {"model": seq2seq["t5"].name})
    stacks = {s.name: s for s in t5.stacks}
    assert list(stacks) == ["encoder", "decoder", "cross"]
    assert [stacks[n].num_layers for n in stacks] == [2, 3, 3]
    assert all(s.num_heads == 4 and s.num_kv_heads == 4 and s.head_dim == 8 and s.qk_dim == 8 for s in t5.stacks)
    assert stacks["encoder"].score_terms == ["relative position bias"] == stacks["decoder"].score_terms
    assert stacks["cross"].score_terms == [] and not stacks["cross"].causal and stacks["decoder"].causal
    assert stacks["encoder"].scaling == 1.0  # T5 does not scale q·k
    bart = {s.name: s for s in TOOLS["describe_model"](inspector, {"model": seq2seq["bart"].name}).stacks}
    assert bart["cross"].scaling == pytest.approx(8**-0.5, abs=1e-6) and bart["cross"].scaling_ratio == 1.0
    assert [s.name for s in TOOLS["describe_model"](inspector, {"model": gpt2.name}).stacks] == ["self"]


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_reconstruct_shows_t5s_relative_position_bias_as_a_stage(seq2seq, inspector, stack):
    report = TOOLS["reconstruct_attention"](
        inspector, {"model": seq2seq["t5"].name, "text": TEXT, "layer": 1, "head": 2, "attention": stack}
    )
    names = [s.name for s in report.stages]
    assert names == ["raw_dot_product", "scaled_dot_product", "projected", "positional", "score_terms", "model"]
    assert report.stages[4].added.startswith("+ relative position bias")
    assert report.score_terms == ["relative position bias"]
    assert report.model_weight_error <= 1e-5 and report.matches_model
    assert report.stages[-1].masked_js_to_model == 0.0
    assert report.stages[4].masked_js_to_model < report.stages[3].masked_js_to_model  # the bias matters


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_trace_reads_the_inputs_segments_through_cross_attention(seq2seq, inspector, family):
    loaded = seq2seq[family]
    arguments = {
        "model": loaded.name, "prompt": TEXT, "segments": [{"name": "reason", "text": "because it was tired"}],
        "target": "generate", "max_new_tokens": 4,
    }  # fmt: skip
    report = TOOLS["trace_prompt_attention"](inspector, arguments)
    assert report.attention == "cross" and report.summary.startswith("On the cross-attention")
    rows, _ = _eager(loaded, inspector, "cross")  # decoder rows of the model's own greedy answer
    answer = len(report.generated)
    assert answer >= 1
    cross = torch.stack([r[0] for r in rows])[:, :, :answer]  # (L, H, n, Tk): the rows that chose the answer
    encoder, _ = _eager(loaded, inspector, "encoder")
    rollout = torch.eye(encoder[0].shape[-1])
    for layer in encoder:  # (1 − r)·A + r·I, rows renormalised, multiplied layer after layer (r = 0.5)
        mixed = 0.5 * layer[0].mean(0) + 0.5 * torch.eye(layer.shape[-1])
        rollout = (mixed / mixed.sum(-1, keepdim=True)) @ rollout
    carried = cross.mean((0, 1, 2)) @ rollout  # (Tk,) the answer's cross-attention carried back to the input
    for segment in report.segments:
        expected = float(cross[..., segment.positions].sum(-1).mean())
        assert segment.share == pytest.approx(expected, abs=1e-4)
        assert segment.rollout_share == pytest.approx(float(carried[segment.positions].sum()), abs=1e-4)
    assert [row.position for row in report.generated] == list(range(answer))
    peaks = [f.position for f in report.findings if f.kind == "peak"]  # the decoder rows too, not input positions
    assert set(peaks) <= set(range(answer)) and (answer < 2 or peaks)
    with pytest.raises(InvalidInputError, match="not run on an encoder–decoder"):
        TOOLS["trace_prompt_attention"](inspector, {"model": loaded.name, "prompt": TEXT, "checks": ["causal"]})


def test_compare_prompts_compares_cross_attention_traces(seq2seq, inspector):
    arguments = {"model": seq2seq["t5"].name, "prompt_a": TEXT, "prompt_b": TEXT.replace("cat", "dog")}
    report = TOOLS["compare_prompts"](inspector, arguments)
    assert report.attention == "cross" and report.summary.startswith("On the cross-attention")
    assert report.next_token_kl is not None and report.next_token_kl > 0


def test_reconstruct_shows_gpt_oss_sink_logits_beside_first_token_sinks(inspector):
    from families import COVERAGE_BY_NAME

    loaded = register_model("tiny-stack-gpt-oss", COVERAGE_BY_NAME["gpt_oss"].build(), tiny_tokenizer())
    report = TOOLS["reconstruct_attention"](inspector, {"model": loaded.name, "text": TEXT, "layer": 1, "head": 2})
    assert report.model_weight_error <= 1e-5 and report.score_terms == ["sink logit"]
    assert report.stages[-1].added.startswith("+ sink logit")
    sinks = loaded.model.model.layers[1].self_attn.sinks.tolist()
    assert [s.sink_logit for s in report.head_sinks] == pytest.approx(sinks)
    # the captured weights are the real keys' only: each head's rows sum to 1 − its sink's share
    encoded = inspector.encode(loaded, TEXT)
    with torch.no_grad():
        out = loaded.model(input_ids=encoded.input_ids, output_attentions=True)
    weights = out.attentions[1][0]  # (H, T, T) real columns
    for row in report.head_sinks:
        assert row.sink_share == pytest.approx(float(1 - weights[row.head].sum(-1).mean()), abs=1e-4)
        assert row.first_token_share == pytest.approx(float(weights[row.head, :, 0].mean()), abs=1e-4)
    assert max(report.head_sinks, key=lambda s: s.sink_share).head == 2  # the largest sink logit takes most


def test_a_stack_with_its_own_head_count_is_sliced_by_its_own_widths(inspector):
    """BART with 4 encoder heads and 2 decoder heads over d_model 32: the encoder's heads are 8 wide, the decoder's
    16. Each head's W_Q/W_K/W_V slice is read by its own stack's width (the default stack's 8 put decoder head 1 at
    feature 8, inside head 0), so the weights rebuild the model's own decoder map."""
    from agent_tools.layout import head_projections, qkv_reads

    model = _bart(decoder_heads=2)
    loaded = register_model("tiny-stack-bart-2-heads", model, tiny_tokenizer())
    assert (loaded.facts.stack("encoder").head_dim, loaded.facts.stack("decoder").head_dim) == (8, 16)
    attention = model.model.decoder.layers[1].self_attn
    for head in range(2):
        rows = slice(16 * head, 16 * (head + 1))
        projections = head_projections(model, 1, head, stack="decoder")
        for got, module in ((projections.w_q, "q_proj"), (projections.w_k, "k_proj"), (projections.w_v, "v_proj")):
            assert torch.equal(got, getattr(attention, module).weight[rows].T.float())
    _, reads = qkv_reads(model, 1, stack="decoder")
    assert [reads[("Q", h)][1] for h in range(2)] == [reads[("K", h)][1] for h in range(2)] == [0, 16]
    report = TOOLS["inspect_projections"](
        inspector, {"model": loaded.name, "text": TEXT, "layer": 1, "head": 1, "attention": "decoder"}
    )
    assert report.model_weight_error < 1e-5
