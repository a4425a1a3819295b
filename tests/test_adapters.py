"""Adapters for families outside the attention interface: BLOOM, MPT, Falcon (ALiBi and rotary), DeBERTa-v2.

The routed forward must leave the model's outputs unchanged and hand an attention function exactly the q, k, v,
mask, scaling and additive term the family uses: the weights an eager attention function computes from them equal
the family's own ``output_attentions`` (on peaked maps), and the logits equal the model's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import torch
import transformers as tf
from adapted import CONFIGS, DOUBLE_ALIBI_EAGER, VOCAB, build, falcon_alibi_reference, inputs, peaked_share
from reference import KeepAll
from torch import Tensor, nn

from agent_tools.adapters import ADAPTERS, adapter_for
from agent_tools.capture import attention_implementation, capture_attention
from agent_tools.errors import InvalidInputError, UnsupportedModelError
from agent_tools.families import read_facts
from agent_tools.intervene import heads_ablated
from agent_tools.layout import apply_rotary, head_projections, output_projection

ATOL = 1e-5


@pytest.fixture(autouse=True)
def _no_grad():
    """Every test here runs without autograd (a module-level switch would leak into later test files)."""
    with torch.no_grad():
        yield


class EagerAttention:
    """An attention function with the interface's signature doing eager math; it keeps what it was given."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None,
        *,
        scaling: float,
        dropout: float = 0.0,
        position_bias: Tensor | None = None,
        score_terms: tuple[str, ...] = (),
    ) -> tuple[Tensor, Tensor]:
        groups = query.shape[1] // key.shape[1]
        key_heads = key.repeat_interleave(groups, dim=1)  # (B, H, Tk, D): head h reads KV head h // groups
        value_heads = value.repeat_interleave(groups, dim=1)
        scores = query @ key_heads.transpose(-1, -2) * scaling
        if position_bias is not None:
            scores = scores + position_bias
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        output = weights @ value_heads  # (B, H, q, D)
        call = {"module": module, "query": query, "key": key, "value": value, "output": output, "mask": mask}
        call.update(weights=weights, scaling=scaling, bias=position_bias, terms=score_terms, dropout=dropout)
        self.calls.append(call)
        return output.transpose(1, 2).contiguous(), weights


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = [(name, module) for name, module in model.named_modules() if adapter_for(module) is not None]
    return sorted(found, key=lambda item: adapter_for(item[1]).layer_index(item[1], item[0]))  # type: ignore[union-attr]


@contextmanager
def routed(model: nn.Module, attention_fn: EagerAttention) -> Iterator[None]:
    with ExitStack() as stack:
        for _, module in attention_modules(model):
            adapter = adapter_for(module)
            assert adapter is not None
            stack.enter_context(adapter.routed(module, attention_fn))
        yield


def output_of(output: Any) -> Tensor:
    return output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state


def eager_reference(model: nn.Module, batch: dict[str, Tensor]) -> Any:
    """The family's own eager attention. (Falcon's default sdpa config with output_attentions=True takes its eager
    branch with sdpa's boolean mask, which it adds as 0/1: no causal mask at all, so the eager config it is.)"""
    with attention_implementation(model, "eager"):
        return model(**batch, output_attentions=True)


def valid_rows(name: str, mask: Tensor) -> Tensor:
    """(B, 1, T, 1) rows that are real tokens (a padded query row's weights are arbitrary in sdpa)."""
    return mask.bool()[:, None, :, None]


@pytest.fixture(scope="module", params=tuple(CONFIGS))
def family(request: pytest.FixtureRequest) -> tuple[str, nn.Module]:
    return request.param, build(request.param)


def test_routed_forward_keeps_outputs_and_reproduces_eager_weights(family: tuple[str, nn.Module]) -> None:
    name, model = family
    batch = inputs(name)
    own = model(**batch)  # the model's default forward (sdpa for Falcon, eager elsewhere)
    eager = eager_reference(model, batch)
    fn = EagerAttention()
    with routed(model, fn):
        mine = model(**batch, output_attentions=True)
    rows = batch["attention_mask"].bool()
    assert (output_of(mine) - output_of(own))[rows].abs().max() < ATOL
    if name not in DOUBLE_ALIBI_EAGER:
        assert (output_of(mine) - output_of(eager))[rows].abs().max() < ATOL
    layers = len(attention_modules(model))
    assert len(fn.calls) == layers == len(mine.attentions)
    keep = valid_rows(name, batch["attention_mask"])
    share = peaked_share([call["weights"] for call in fn.calls], keep)
    assert share >= 0.2  # peaked maps, or the comparison could not see an error
    for layer, call in enumerate(fn.calls):
        assert call["weights"] is mine.attentions[layer]  # what the module returns is what the function computed
        if name in DOUBLE_ALIBI_EAGER:
            continue
        reference = eager.attentions[layer]
        assert (call["weights"] - reference).masked_fill(~keep, 0).abs().max() < ATOL


def test_falcon_alibi_matches_its_default_path_and_eager_adds_alibi_twice() -> None:
    """Falcon-ALiBi: the captured weights are softmax(q·kᵀ/√D + alibi/√D + mask) (its sdpa path, and ALiBi's
    definition) rebuilt here from the model's own q, k; transformers' eager output_attentions equals the same with
    the ALiBi term doubled (its eager branch adds alibi/√D to a mask that already holds it)."""
    model = build("falcon_alibi")
    batch = inputs("falcon_alibi")
    eager = eager_reference(model, batch)
    fn = EagerAttention()
    with routed(model, fn):
        model(**batch)
    keep = valid_rows("falcon_alibi", batch["attention_mask"])
    heads, dim = 4, 8
    cumulative = (batch["attention_mask"].cumsum(-1) - 1) * batch["attention_mask"]  # (B, T) ALiBi positions
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)  # (H,) for a power-of-two head count
    alibi = slopes.bfloat16()[None, :, None, None] * cumulative[:, None, None, :]  # Falcon rounds slopes to bf16
    alibi = alibi.float() / dim**0.5  # (B, H, 1, T)
    length = batch["input_ids"].shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = causal[None, None] & batch["attention_mask"].bool()[:, None, None, :]  # (B, 1, T, T)
    once_by_the_model = falcon_alibi_reference(model, **batch)  # its own eager code, mask freed of merged ALiBi
    rows = batch["attention_mask"].bool()
    assert (output_of(once_by_the_model) - output_of(model(**batch)))[rows].abs().max() < ATOL  # = default sdpa
    for layer, call in enumerate(fn.calls):
        assert (call["weights"] - once_by_the_model.attentions[layer]).masked_fill(~keep, 0).abs().max() < ATOL
        assert call["terms"] == ("ALiBi",)
        scores = call["query"] @ call["key"].transpose(-1, -2) / dim**0.5
        blocked = torch.finfo(scores.dtype).min
        once = torch.softmax((scores + alibi).masked_fill(~allowed, blocked), -1)
        twice = torch.softmax((scores + 2 * alibi).masked_fill(~allowed, blocked), -1)
        assert (call["weights"] - once).masked_fill(~keep, 0).abs().max() < ATOL
        if layer == 0:  # later layers' inputs differ between the two paths
            assert (eager.attentions[0] - twice).masked_fill(~keep, 0).abs().max() < ATOL
            assert (eager.attentions[0] - once).masked_fill(~keep, 0).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon_alibi", "falcon", "falcon_mq"])
def test_routed_forward_with_a_kv_cache(name: str) -> None:
    """Prefill then two cached decode steps: the routed model's logits equal the original's at every step."""
    model = build(name)
    ids = inputs(name)["input_ids"][:1]

    def steps() -> list[Tensor]:
        out = model(ids[:, :8], use_cache=True)
        logits = [out.logits]
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        for position in (8, 9):
            out = model(ids[:, position : position + 1], cache=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
        return logits

    own = steps()
    fn = EagerAttention()
    with routed(model, fn):
        mine = steps()
    for reference, routed_logits in zip(own, mine, strict=True):
        assert (routed_logits - reference).abs().max() < ATOL
    assert fn.calls[-1]["query"].shape[2] == 1 and fn.calls[-1]["key"].shape[2] == 10  # one query row, 10 keys


@pytest.mark.parametrize(
    ("name", "terms", "kv_heads", "scaling"),
    [
        ("bloom", ("ALiBi",), 4, 8**-0.5),
        ("mpt", ("ALiBi",), 4, 8**-0.5),
        ("mpt_clip", ("ALiBi",), 4, 0.6),
        ("falcon_alibi", ("ALiBi",), 4, 8**-0.5),
        ("falcon_alibi_mq", ("ALiBi",), 1, 8**-0.5),
        ("falcon", (), 2, 8**-0.5),
        ("falcon_mq", (), 1, 8**-0.5),
        ("deberta_v3", ("c2p/p2c",), 4, (8 * 3) ** -0.5),
        ("deberta_v2", ("c2p/p2c",), 4, (8 * 2) ** -0.5),
        ("deberta_plain", (), 4, 8**-0.5),
    ],
)
def test_facts_and_terms_handed_to_the_attention_function(
    name: str, terms: tuple[str, ...], kv_heads: int, scaling: float
) -> None:
    model = build(name)
    batch = inputs(name)
    fn = EagerAttention()
    with routed(model, fn):
        model(**batch)
    modules = attention_modules(model)
    facts = read_facts(model).stack()  # heads and widths are read like any module's
    for layer, ((module_name, module), call) in enumerate(zip(modules, fn.calls, strict=True)):
        adapter = adapter_for(module)
        assert adapter is not None
        assert adapter.layer_index(module, module_name) == layer
        assert call["module"] is module
        assert call["terms"] == terms == adapter.score_terms(module) == facts.score_terms
        assert facts.num_kv_heads == kv_heads == call["key"].shape[1]
        assert facts.num_heads == 4 == call["query"].shape[1]
        assert facts.head_dim == facts.qk_dim == 8 == call["query"].shape[-1]
        assert call["scaling"] == pytest.approx(scaling, rel=1e-6) and adapter.scaling(module) == call["scaling"]
        batch_size, _, length, keys = call["weights"].shape
        if terms:
            assert call["bias"].shape == (batch_size, 4, length, keys)
        else:
            assert call["bias"] is None
        allowed = call["mask"] > torch.finfo(call["mask"].dtype).min / 2  # a 0 / dtype-min mask
        assert call["mask"].shape == (batch_size, 1, length, keys)
        assert bool((call["mask"][allowed] == 0).all())
        assert facts.is_causal == (not name.startswith("deberta"))
        if facts.is_causal:
            assert not bool(allowed[0, 0].triu(1).any())


def test_alibi_terms_are_the_families_slopes_times_key_position() -> None:
    """Hand-computed ALiBi: BLOOM adds slope_h · j (j = key position), MPT slope_h · (j − Tk + 1)."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, 5) / 4)  # (H,) = 1/4, 1/16, 1/64, 1/256 for 4 heads, bias max 8
    for name, offset in (("bloom", 0), ("mpt", 1 - 11)):
        model = build(name)
        fn = EagerAttention()
        with routed(model, fn):
            model(inputs(name)["input_ids"][:1])
        expected = slopes[:, None] * (torch.arange(11) + offset)  # (H, Tk)
        for call in fn.calls:
            assert (call["bias"][0, :, 0] - expected).abs().max() < 1e-6
            assert bool((call["bias"][0, :, 5] == call["bias"][0, :, 0]).all())  # the same for every query row


def test_forward_restored_after_the_block_and_after_an_error() -> None:
    model = build("bloom")
    modules = [module for _, module in attention_modules(model)]
    fn = EagerAttention()
    with routed(model, fn):
        assert all("forward" in module.__dict__ for module in modules)
    assert not any("forward" in module.__dict__ for module in modules)

    def failing(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        raise RuntimeError("attention function failed")

    with pytest.raises(RuntimeError, match="attention function failed"), routed(model, failing):  # type: ignore[arg-type]
        model(inputs("bloom")["input_ids"])
    assert not any("forward" in module.__dict__ for module in modules)
    assert model(inputs("bloom")["input_ids"]).logits.isfinite().all()


def test_adapter_matches_only_its_own_classes() -> None:
    llama = tf.AutoModelForCausalLM.from_config(
        tf.LlamaConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32, vocab_size=32)
    )
    small = {"num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 16, "intermediate_size": 32}
    deberta_v1 = tf.AutoModel.from_config(tf.DebertaConfig(**small, vocab_size=32))
    assert not any(adapter_for(module) for module in llama.modules())
    assert not any(adapter_for(module) for module in deberta_v1.modules())  # DeBERTa v1 is a different module
    found = [adapter_for(m) for n in ("bloom", "mpt", "falcon", "deberta_v3") for m in build(n).modules()]
    families = {adapter.family for adapter in found if adapter is not None}
    assert families == {adapter.family for adapter in ADAPTERS} == {"bloom", "mpt", "falcon", "deberta-v2"}


def test_refusals_say_why() -> None:
    model = build("bloom")
    module = attention_modules(model)[0][1]
    adapter = adapter_for(module)
    assert adapter is not None
    module.beta = 0.5
    with pytest.raises(UnsupportedModelError, match="beta"), adapter.routed(module, EagerAttention()):
        pass
    assert "forward" not in module.__dict__
    deberta = build("deberta_v3")
    attention = attention_modules(deberta)[0][1]
    with pytest.raises(UnsupportedModelError, match=r"\.layer\.<i>\."):
        adapter_for(attention).layer_index(attention, "")  # type: ignore[union-attr]


# --- weight layouts: per-head W_Q, W_K, W_V, W_O and the output projection (layout.py) -----------------------
PROJECTION_CASES = (
    "bloom",
    "mpt",
    "falcon_alibi",
    "falcon_alibi_mq",
    "falcon",
    "falcon_mq",
    "deberta_v3",
    "deberta_v2",
)


@pytest.mark.parametrize("name", PROJECTION_CASES)
def test_per_head_projections_reproduce_the_adapters_q_k_v(name: str) -> None:
    """x·W_Q^h + b_Q^h (then RoPE for rotary Falcon) is the query the adapter hands over, per head; keys and
    values per KV head likewise; Σ_h z_h·W_O^h + b_O is what the output projection makes of the heads' outputs."""
    model = build(name)
    batch = inputs(name)
    modules = [module for _, module in attention_modules(model)]
    seen: dict[int, tuple[Tensor, Any]] = {}

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        seen[id(module)] = (hidden, kwargs.get("position_embeddings"))

    handles = [module.register_forward_pre_hook(record, with_kwargs=True) for module in modules]
    fn = EagerAttention()
    try:
        with routed(model, fn):
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    for layer, (module, call) in enumerate(zip(modules, fn.calls, strict=True)):
        hidden, rotary = seen[id(module)]
        projection = output_projection(model, layer, in_features=4 * 8)
        written = torch.zeros(())
        for head in range(4):
            weights = head_projections(model, layer, head)
            query, key = (
                hidden @ w + (b if b is not None else 0.0)
                for w, b in ((weights.w_q, weights.b_q), (weights.w_k, weights.b_k))
            )  # (B, T, D)
            value = weights.values(hidden)
            if rotary is not None and "ALiBi" not in call["terms"]:
                cos, sin = rotary
                query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
            assert weights.kv_head == head // (4 // call["key"].shape[1])
            assert (query - call["query"][:, head]).abs().max() < ATOL
            assert (key - call["key"][:, weights.kv_head]).abs().max() < ATOL
            assert (value - call["value"][:, weights.kv_head]).abs().max() < ATOL
            written = written + call["output"][:, head] @ weights.w_o  # (B, T, C)
        heads_out = call["output"].transpose(1, 2).reshape(*hidden.shape[:2], -1)  # (B, T, H·D)
        bias = projection.bias if projection.bias is not None else 0.0
        assert (written + bias - projection(heads_out)).abs().max() < ATOL


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon", "falcon_alibi_mq", "deberta_v3"])
def test_head_ablation_hooks_remove_exactly_that_heads_output(name: str) -> None:
    """Zeroing head 2 of layer 1 with the projection pre-hook equals routing an attention function that zeroes
    that head's output: the hook finds the right projection and the right H·D columns."""
    model = build(name)
    batch = inputs(name)
    with heads_ablated(model, {1: [2]}, num_heads=4, head_dim=8):
        ablated = output_of(model(**batch))

    class ZeroHead(EagerAttention):
        def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
            output, weights = super().__call__(module, *args, **kwargs)
            if module is attention_modules(model)[1][1]:
                output = output.clone()
                output[:, :, 2] = 0  # (B, q, H, D)
            return output, weights

    with routed(model, ZeroHead()):
        zeroed = output_of(model(**batch))
    rows = batch["attention_mask"].bool()
    assert (ablated - zeroed)[rows].abs().max() < ATOL
    assert (ablated - output_of(model(**batch)))[rows].abs().max() > 1e-3  # the head mattered


def test_mpt_input_longer_than_its_alibi_is_refused_with_the_limit() -> None:
    model = build("mpt")  # max_seq_len = 64: the model's own forward fails on more (its ALiBi has 64 columns)
    ids = torch.randint(6, VOCAB, (1, 65))
    with pytest.raises(RuntimeError):
        model(ids)
    with pytest.raises(InvalidInputError, match="at most 64 tokens"), routed(model, EagerAttention()):
        model(ids)
    assert output_of(model(ids[:, :64])).isfinite().all()


def test_only_rotary_falcon_uses_its_position_embeddings() -> None:
    """Falcon passes (cos, sin) to every layer; only the rotary variant applies them."""
    for name, rotary in (("falcon", True), ("falcon_mq", True), ("falcon_alibi", False), ("bloom", False)):
        module = attention_modules(build(name))[0][1]
        assert adapter_for(module).uses_rotary(module) is rotary  # type: ignore[union-attr]


def test_projection_refusals_name_the_reason() -> None:
    with pytest.raises(UnsupportedModelError, match="clip_qkv"):
        head_projections(build("mpt_clip"), 0, 0)
    with pytest.raises(UnsupportedModelError, match="slow_but_exact"):
        output_projection(build("bloom_tp"), 0)


# --- through capture_attention (agent_tools.capture routes these modules with their adapters) ------------------
EXPECTED_TERMS = {
    "bloom": ("ALiBi",),
    "bloom_tp": ("ALiBi",),
    "mpt": ("ALiBi",),
    "mpt_clip": ("ALiBi",),
    "falcon_alibi": ("ALiBi",),
    "falcon_alibi_mq": ("ALiBi",),
    "falcon": (),
    "falcon_mq": (),
    "deberta_v3": ("c2p/p2c",),
    "deberta_v2": ("c2p/p2c",),
    "deberta_plain": (),
}


def reference_weights(name: str, model: nn.Module, batch: dict[str, Tensor]) -> list[Tensor]:
    """The family's own eager weights; for Falcon-ALiBi its default path's (ALiBi once), see the test above."""
    if name not in DOUBLE_ALIBI_EAGER:
        return list(eager_reference(model, batch).attentions)
    return list(falcon_alibi_reference(model, **batch).attentions)


@pytest.mark.parametrize("query_chunk", [None, 4])
def test_capture_attention_is_exact_on_adapted_families(family: tuple[str, nn.Module], query_chunk: int | None) -> None:
    """capture_attention with a consumer: weights equal the family's own, terms are named, the bias is inside the
    scores (softmax(scores + mask) = weights), and the model's output is unchanged — also in chunks of 4 rows."""
    name, model = family
    batch = inputs(name)
    own = output_of(model(**batch))
    reference = reference_weights(name, model, batch)
    keep = KeepAll()
    with capture_attention(model, [keep], query_chunk=query_chunk):
        captured = output_of(model(**batch))
    rows = batch["attention_mask"].bool()
    assert (captured - own)[rows].abs().max() < ATOL
    valid = valid_rows(name, batch["attention_mask"])
    assert sorted(keep.layers) == list(range(len(reference)))
    for layer, expected in enumerate(reference):
        weights = keep.weights(layer)
        assert (weights - expected).masked_fill(~valid, 0).abs().max() < ATOL
        last = keep.layers[layer]
        assert last.terms == EXPECTED_TERMS[name]
        assert last.stack == "self"
        if last.terms:
            assert last.bias is not None and last.bias.shape[1] == 4
        else:
            assert last.bias is None
        rebuilt = torch.softmax(last.scores + last.mask, dim=-1) if last.mask is not None else None
        assert rebuilt is not None and (rebuilt - last.weights).abs().max() < ATOL


@pytest.mark.parametrize("name", ["bloom", "falcon", "falcon_mq", "deberta_v3"])
def test_capture_of_one_layer_leaves_the_others_exact(name: str) -> None:
    """Layers nobody asked for run uncaptured (sdpa where no term is added); the output stays the model's own."""
    model = build(name)
    batch = inputs(name)
    own = output_of(model(**batch))
    reference = reference_weights(name, model, batch)
    keep = KeepAll()
    with capture_attention(model, [keep], layers=[1]):
        captured = output_of(model(**batch))
    rows = batch["attention_mask"].bool()
    assert (captured - own)[rows].abs().max() < ATOL
    assert sorted(keep.layers) == [1]
    valid = valid_rows(name, batch["attention_mask"])
    assert (keep.weights(1) - reference[1]).masked_fill(~valid, 0).abs().max() < ATOL


def test_routed_forward_runs_inside_accelerate_hooks() -> None:
    """With accelerate's hook on a module (device maps, offload), the hook's pre_forward still runs and then the
    routed forward; afterwards the hook wraps the original forward again."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            Counting.calls += 1
            return args, kwargs

    model = build("falcon")
    batch = inputs("falcon")
    own = output_of(model(**batch))
    module = attention_modules(model)[0][1]
    add_hook_to_module(module, Counting())
    original = module._old_forward
    try:
        fn = EagerAttention()
        with routed(model, fn):
            mine = output_of(model(**batch))
        assert module._old_forward is original and Counting.calls == 1
        assert len(fn.calls) == 2 and fn.calls[0]["module"] is module
        rows = batch["attention_mask"].bool()
        assert (mine - own)[rows].abs().max() < ATOL
        model(**batch)
        assert Counting.calls == 2 and len(fn.calls) == 2  # the original forward again, still behind the hook
    finally:
        remove_hook_from_module(module)
