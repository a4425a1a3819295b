"""Where each family keeps its attention weights: W_Q, W_K, W_V, W_O and the output projection module.

This is the one adapter per weight layout; nothing else looks up projection attributes. Every family stores
the same four maps differently (separate ``q_proj``/``k_proj``/``v_proj``, BERT's ``query``/``key``/``value``,
GPT-2's fused ``c_attn`` Conv1D laid out ``(in, out)``, GPT-NeoX's fused ``query_key_value`` interleaved per
head, Phi-3's fused ``qkv_proj``); :data:`LAYOUTS` says which, :data:`PROJECTION_FAMILIES` which family uses
which. Head counts and the query pre-scale come from :class:`~agent_tools.families.ModelFacts`, the only reader
of the config.

Two conventions (TransformerLens'): :func:`head_projections` gives ``q = x @ w_q + b_q`` with ``w_q`` of shape
``(d_model, d_head)`` and the head's write into the residual stream ``z @ w_o`` with ``w_o`` ``(d_head, d_model)``;
:func:`output_weight` gives the whole output projection as nn.Linear stores it, ``(C, H·D)``.

The output projection (what ablation hooks and value norms read) is found for every family the same way: the
first of :data:`OUTPUT_PROJECTION_NAMES` on the attention module, else BERT's sibling ``output.dense``. Per-head
W_Q/W_K/W_V slices are read only for the families in :data:`PROJECTION_FAMILIES`; others are refused with
:class:`UnsupportedModelError`: a wrong slice gives plausible-looking but wrong numbers, so we never guess.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Literal, TypeGuard

import torch
from torch import Tensor, nn

from agent_tools.adapters import rotate_half
from agent_tools.errors import UnsupportedModelError
from agent_tools.families import ModelFacts, StackFacts, find_attention_modules, read_facts

ProjectionLayout = Literal[
    "separate",
    "bert",
    "gpt2_conv1d",
    "neox_fused",
    "phi3_fused",
    "t5",
    "mpt_fused",
    "deberta",
    "falcon_multi_query",
    "falcon_grouped",
]
QKVStorage = Literal["separate", "fused_blocks", "fused_per_head", "fused_grouped"]


@dataclass(frozen=True)
class WeightLayout:
    """How one layout stores W_Q, W_K, W_V on the attention module.

    ``separate``: three modules named by ``modules`` (query, key, value), head ``h`` owning output features
    ``h·D .. (h+1)·D − 1`` of each. ``fused_blocks``: one module whose output features are
    ``[all query heads | all key heads | all value heads]``. ``fused_per_head``: one module viewed as
    ``(H, 3·D)``, head ``h`` owning ``h·3·D + [q | k | v]``. ``fused_grouped`` (Falcon's new decoder
    architecture): one module viewed as ``(Hkv, g + 2, D)`` with ``g = H / Hkv``: KV group ``j`` holds its ``g``
    query heads, then its key, then its value. Whether a module is stored ``(out, in)``
    (nn.Linear) or ``(in, out)`` (GPT-2's Conv1D) is read from the module itself.
    """

    name: ProjectionLayout
    storage: QKVStorage
    modules: tuple[str, ...]


LAYOUTS: dict[ProjectionLayout, WeightLayout] = {
    "separate": WeightLayout("separate", "separate", ("q_proj", "k_proj", "v_proj")),
    "bert": WeightLayout("bert", "separate", ("query", "key", "value")),
    "gpt2_conv1d": WeightLayout("gpt2_conv1d", "fused_blocks", ("c_attn",)),
    "neox_fused": WeightLayout("neox_fused", "fused_per_head", ("query_key_value",)),
    "phi3_fused": WeightLayout("phi3_fused", "fused_blocks", ("qkv_proj",)),
    "t5": WeightLayout("t5", "separate", ("q", "k", "v")),
    "mpt_fused": WeightLayout("mpt_fused", "fused_blocks", ("Wqkv",)),
    "deberta": WeightLayout("deberta", "separate", ("query_proj", "key_proj", "value_proj")),
    "falcon_multi_query": WeightLayout("falcon_multi_query", "fused_blocks", ("query_key_value",)),
    "falcon_grouped": WeightLayout("falcon_grouped", "fused_grouped", ("query_key_value",)),
}

# model_type -> how its attention stores W_Q, W_K, W_V. Each is covered by a tiny-model parity test.
PROJECTION_FAMILIES: dict[str, ProjectionLayout] = {
    "llama": "separate",
    "mistral": "separate",
    "qwen2": "separate",
    "gemma2": "separate",
    "opt": "separate",
    "bert": "bert",
    "gpt2": "gpt2_conv1d",
    "gpt_neox": "neox_fused",
    "phi3": "phi3_fused",
    "bart": "separate",
    "t5": "t5",
    "gpt_oss": "separate",
    "bloom": "neox_fused",  # query_key_value viewed (H, 3, D), like GPT-NeoX
    "mpt": "mpt_fused",
    "falcon": "neox_fused",  # multi-query and new-decoder-architecture variants: _module_layout
    "deberta-v2": "deberta",
}
SUPPORTED_PROJECTION_FAMILIES: tuple[str, ...] = tuple(PROJECTION_FAMILIES)

# The output projection's name on a self-attention module: Llama-like and Phi-3 ``o_proj``, OPT ``out_proj``,
# GPT-2 ``c_proj``, GPT-NeoX ``dense``, T5 ``o``. BERT-like encoders keep it beside the self-attention, on the
# parent block: ``<parent>.output.dense`` (:data:`SIBLING_OUTPUT_PATH`).
OUTPUT_PROJECTION_NAMES = ("o_proj", "out_proj", "c_proj", "dense", "o")
SIBLING_OUTPUT_PATH = ("output", "dense")


# --- typed access to a projection module -----------------------------------------------------------------
def _is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``transformers.pytorch_utils.Conv1D`` (matched by name: importing transformers here costs ~1 s)."""
    return type(module).__name__ == "Conv1D"


def _is_projection(module: object) -> TypeGuard[nn.Module]:
    """An nn.Linear, or a Conv1D holding a 2-D weight: the modules whose features we know how to slice."""
    if isinstance(module, nn.Linear):
        return True
    if not isinstance(module, nn.Module) or not _is_conv1d(module):
        return False
    weight = getattr(module, "weight", None)
    return isinstance(weight, Tensor) and weight.dim() == 2


def _out_in(module: nn.Module) -> Tensor:
    """The projection's weight as nn.Linear stores it, ``(out, in)`` (a view: Conv1D stores ``(in, out)``)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        msg = f"{type(module).__name__} has no weight tensor; cannot read a projection from it"
        raise UnsupportedModelError(msg)
    return weight.t() if _is_conv1d(module) else weight


def _child(module: nn.Module, name: str) -> nn.Module:
    """A named projection submodule, or UnsupportedModelError naming what is missing."""
    child = getattr(module, name, None)
    if not _is_projection(child):
        msg = f"{type(module).__name__} has no projection {name!r} where its family's weight layout keeps one"
        raise UnsupportedModelError(msg, field="model")
    return child


def _features(module: nn.Module, start: int, size: int) -> tuple[Tensor, Tensor | None]:
    """Output features ``start .. start+size`` as an ``(in, size)`` float weight plus their bias (copies)."""
    weight = _out_in(module).detach()[start : start + size].T.float().clone()  # (d_model, size)
    bias = getattr(module, "bias", None)
    return weight, bias.detach()[start : start + size].float().clone() if isinstance(bias, Tensor) else None


# --- the output projection (every family) ----------------------------------------------------------------
def _own_output(attention: nn.Module) -> nn.Module | None:
    """The first of :data:`OUTPUT_PROJECTION_NAMES` the attention module holds as a projection."""
    for name in OUTPUT_PROJECTION_NAMES:
        child = getattr(attention, name, None)
        if _is_projection(child):
            return child
    return None


def _sibling_output(model: nn.Module, attention: nn.Module) -> nn.Module | None:
    """BERT keeps W_O outside the self-attention module: ``<parent>.output.dense``."""
    path = next((name for name, module in model.named_modules() if module is attention), "")
    found: object = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
    for name in SIBLING_OUTPUT_PATH:
        found = getattr(found, name, None)
    return found if _is_projection(found) else None


def output_projection(
    model: nn.Module, layer: int, *, in_features: int | None = None, stack: str | None = None
) -> nn.Module:
    """The module that maps layer ``layer``'s concatenated head outputs (…, H·D) into the residual stream.

    Args:
        model: any model :func:`~agent_tools.families.find_attention_modules` handles.
        layer: attention layer index (already validated by the caller).
        in_features: when given (``heads × head_dim``), a projection taking another number of features is
            refused: per-head slices of it (ablation, W_O^h) would be wrong.
        stack: the attention stack ``layer`` counts in (None = the model's default stack).
    """
    attention = find_attention_modules(model, stack)[layer]
    if getattr(attention, "pretraining_tp", 1) > 1 and getattr(attention, "slow_but_exact", False):
        msg = (
            f"layer {layer} ({type(attention).__name__}, pretraining_tp={attention.pretraining_tp} with "
            "slow_but_exact) multiplies slices of its output weight directly instead of calling the projection, "
            "so hooks on the projection (head ablation, recorded head outputs) would never run; it is refused"
        )
        raise UnsupportedModelError(msg)
    projection = _own_output(attention) or _sibling_output(model, attention)  # Linear or Conv1D: truthy
    if projection is None:
        msg = (
            f"cannot find the output projection (W_O) of layer {layer} ({type(attention).__name__}); head ablation, "
            "value-side norms and per-head projections need it"
        )
        raise UnsupportedModelError(msg)
    width = int(_out_in(projection).shape[1])
    if in_features is not None and width != in_features:
        msg = (
            f"layer {layer}'s output projection takes {width} features, not heads × head_dim = {in_features}; "
            "per-head slices of it would be wrong, so it is refused"
        )
        raise UnsupportedModelError(msg)
    return projection


def output_weight(model: nn.Module, layer: int, *, stack: str | None = None) -> Tensor:
    """Layer ``layer``'s output projection weight as ``(C, H·D)``, columns grouped by head (detached, as stored)."""
    projection = output_projection(model, layer, stack=stack)
    with materialised(projection):
        return _out_in(projection).detach()


@contextmanager
def materialised(*modules: nn.Module) -> Iterator[None]:
    """Inside the block, weights that accelerate offloaded (to the CPU or disk: the module holds meta placeholders
    between forwards) are loaded, through accelerate's own hooks; outside an offloading device map a no-op.

    Tensors read inside the block stay valid after it (the hook swaps the module's parameters back to meta; the
    loaded tensors live on in whatever still references them).
    """
    offloaded = [sub for module in modules for sub in module.modules() if getattr(sub, "_hf_hook", None) is not None]
    if not offloaded:
        yield
        return
    from accelerate.utils import align_module_device

    with ExitStack() as stack:
        for sub in offloaded:
            stack.enter_context(align_module_device(sub))
        yield


# --- per-head W_Q, W_K, W_V, W_O (the families of PROJECTION_FAMILIES) -----------------------------------
@dataclass(frozen=True)
class HeadProjections:
    """One query head's projection slices (and those of the KV head it reads), detached float tensors.

    ``q = x @ w_q + b_q`` (then RoPE where the family uses it); ``k``, ``v`` likewise for the KV head;
    the head's output ``z`` (d_head,) writes ``z @ w_o`` into the residual stream (before ``b_o``, shared by
    all heads). ``query_prescale`` is the factor some families (OPT) fold into the query projection instead
    of passing it to the attention function; 1.0 elsewhere.
    """

    family: str
    layout: ProjectionLayout
    layer: int
    head: int
    kv_head: int
    w_q: Tensor  # (d_model, d_head)
    b_q: Tensor | None  # (d_head,)
    w_k: Tensor  # (d_model, d_head)
    b_k: Tensor | None
    w_v: Tensor  # (d_model, d_head)
    b_v: Tensor | None
    w_o: Tensor  # (d_head, d_model)
    query_prescale: float = 1.0

    @property
    def d_model(self) -> int:
        return self.w_q.shape[0]

    @property
    def d_head(self) -> int:
        return self.w_q.shape[1]

    def values(self, x: Tensor) -> Tensor:
        """(..., T, d_model) -> (..., T, d_head): the head's values (the parity check compares the model's)."""
        out = x.to(self.w_v.dtype) @ self.w_v
        return out + self.b_v if self.b_v is not None else out


def weight_layout(facts: ModelFacts) -> WeightLayout:
    """The weight layout of a supported family, or UnsupportedModelError naming the supported ones."""
    layout = PROJECTION_FAMILIES.get(facts.family)
    if layout is None:
        msg = (
            f"reading per-head W_Q/W_K/W_V/W_O is not supported for family {facts.family!r}; "
            f"supported families: {', '.join(SUPPORTED_PROJECTION_FAMILIES)}"
        )
        raise UnsupportedModelError(msg, field="model")
    return LAYOUTS[layout]


def _module_layout(layout: WeightLayout, attention: nn.Module) -> WeightLayout:
    """The layout of this attention module where a family's variants differ; refuses what no slice reproduces."""
    name = type(attention).__name__
    if name.startswith("Falcon") and getattr(attention, "new_decoder_architecture", False):
        return LAYOUTS["falcon_grouped"]  # view(B, T, Hkv, g + 2, D)
    if name.startswith("Falcon") and getattr(attention, "multi_query", False):
        return LAYOUTS["falcon_multi_query"]  # view(B, T, H + 2, D): [all Q | K | V]
    clip = getattr(attention, "clip_qkv", None)
    if name == "MptAttention" and clip:
        msg = (
            f"this MPT model clamps its fused q/k/v projection to ±{clip} (clip_qkv), so a head's q is not the "
            "linear map W_Q·x that per-head projections state; they are refused for it"
        )
        raise UnsupportedModelError(msg, field="model")
    return layout


def _qkv_starts(layout: WeightLayout, facts: StackFacts, head: int, kv_head: int) -> tuple[int, int, int]:
    """The first output feature of the head's query, key and value slices in its layout's module(s), by the facts
    of the head's own stack (an encoder–decoder's stacks may differ in heads and widths)."""
    d_head = facts.head_dim
    if layout.storage == "fused_grouped":  # view(B, T, Hkv, g + 2, D): g query heads, the key, the value
        groups = facts.kv_groups
        base = kv_head * (groups + 2) * d_head
        return base + (head % groups) * d_head, base + groups * d_head, base + (groups + 1) * d_head
    if layout.storage == "separate":
        return head * d_head, kv_head * d_head, kv_head * d_head
    if layout.storage == "fused_per_head":  # view(B, T, H, 3·d_head) then chunk(3)
        base = head * 3 * d_head
        return base, base + d_head, base + 2 * d_head
    q_size, kv_size = facts.num_heads * d_head, facts.num_kv_heads * d_head  # [all Q | all K | all V]
    return head * d_head, q_size + kv_head * d_head, q_size + kv_size + kv_head * d_head


def _layer_projections(
    model: nn.Module, layer: int, facts: ModelFacts | None, stack: str | None
) -> tuple[ModelFacts, nn.Module, WeightLayout, StackFacts, list[nn.Module]]:
    """The model's facts, layer ``layer``'s attention module, its weight layout, its stack's facts and its q/k/v
    projection module(s) (one for a fused layout)."""
    facts = facts if facts is not None else read_facts(model)
    layout = weight_layout(facts)
    attention = find_attention_modules(model, stack)[layer]
    layout = _module_layout(layout, attention)
    return facts, attention, layout, facts.stack(stack), [_child(attention, name) for name in layout.modules]


def head_projections(
    model: nn.Module, layer: int, head: int, *, facts: ModelFacts | None = None, stack: str | None = None
) -> HeadProjections:
    """One head's W_Q, W_K, W_V, W_O slices and biases, in the ``x @ W`` convention.

    Args:
        model: a loaded transformers model of a family in :data:`PROJECTION_FAMILIES`.
        layer: attention layer index (already validated by the caller).
        head: query head index (already validated); it reads KV head ``facts.kv_head_of(head)``.
        facts: the model's facts (``LoadedModel.facts``); read from the model when not given.
        stack: the attention stack ``layer`` and ``head`` count in (None = the model's default stack).
    """
    facts, attention, layout, heads, modules = _layer_projections(model, layer, facts, stack)
    d_head, kv_head = heads.head_dim, heads.kv_head_of(head)
    qkv_modules = modules if len(modules) == 3 else modules * 3
    starts = _qkv_starts(layout, heads, head, kv_head)
    projection = output_projection(model, layer, in_features=heads.num_heads * d_head, stack=stack)
    with materialised(*modules, projection):  # a disk-offloaded layer holds meta placeholders between forwards
        q, k, v = (_features(module, start, d_head) for module, start in zip(qkv_modules, starts, strict=True))
        w_o = _out_in(projection).detach()[:, head * d_head : (head + 1) * d_head].T.float().clone()  # (d_head, C)
    prescale = float(getattr(attention, "scaling", 1.0)) if facts.query_prescaled else 1.0
    # the fields in order: family, layout, layer, head, kv_head, (w_q, b_q), (w_k, b_k), (w_v, b_v), w_o, prescale
    return HeadProjections(facts.family, layout.name, layer, head, kv_head, *q, *k, *v, w_o, prescale)


def qkv_reads(
    model: nn.Module, layer: int, *, facts: ModelFacts | None = None, stack: str | None = None
) -> tuple[list[nn.Module], dict[tuple[str, int], tuple[int, int]]]:
    """Where each head reads its q, k and v: the layer's projection module(s), and for ``("Q", head)`` and
    ``("K", kv_head)``/``("V", kv_head)`` the (module index, first output feature) of its ``head_dim`` slice.
    A gradient at a module's output sliced there, times the slice's weight, is the gradient at the residual as
    that head reads it through that path (find_circuit's receivers)."""
    facts, _, layout, heads, modules = _layer_projections(model, layer, facts, stack)
    indices = (0, 1, 2) if len(modules) == 3 else (0, 0, 0)
    reads: dict[tuple[str, int], tuple[int, int]] = {}
    for head in range(heads.num_heads):
        kv_head = heads.kv_head_of(head)
        starts = _qkv_starts(layout, heads, head, kv_head)
        for key, index, start in zip((("Q", head), ("K", kv_head), ("V", kv_head)), indices, starts, strict=True):
            reads.setdefault(key, (index, start))  # a KV head's slice: where its first query head finds it
    return modules, reads


def slice_weight(module: nn.Module, start: int, size: int) -> Tensor:
    """Output features ``start .. start+size`` of a projection as a ``(size, in)`` float weight (x @ W.T)."""
    with materialised(module):
        return _out_in(module).detach()[start : start + size].float().clone()


# --- positions ------------------------------------------------------------------------------------------
def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one tensor: (..., T, d_head) with cos/sin (..., T, d_rot).

    The first ``d_rot = cos.shape[-1]`` dims are rotated in the "rotate_half" layout (Llama, Mistral, Qwen2,
    Gemma2 with ``d_rot = d_head``; GPT-NeoX and Phi with partial rotary ``d_rot < d_head``); the rest pass.
    It lives beside the weight layouts because which dims rotate, and how they pair, is a family's layout of q, k.
    """
    rotary = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
