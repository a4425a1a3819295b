"""What a model's attention *is*: find its attention modules and read the facts that explain it.

Pure inspection of an instantiated model; no forward pass, no hooks.

A model has one or more attention *stacks*. Decoder-only and encoder-only models have one, ``"self"``. An
encoder–decoder has three: ``"encoder"`` (encoder self-attention), ``"decoder"`` (decoder self-attention) and
``"cross"`` (decoder queries reading the encoder's keys and values). Layers are numbered within their stack.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from agent_tools.adapters import ALIBI, DISENTANGLED, FamilyAdapter, adapter_for
from agent_tools.errors import InvalidInputError, UnsupportedModelError

# Families whose attention module multiplies the query by the scale inside its projection step and then passes
# ``scaling=1.0`` to the attention function (so captured queries are already scaled). Checked against the
# transformers source this project pins (BART, mBART, Marian, Pegasus pass ``scaling=self.scaling`` since 5.x);
# ``tests/test_family_coverage.py`` asserts it for every family of the coverage list.
QUERY_PRESCALED_FAMILIES = frozenset({"opt", "whisper", "xglm", "trocr", "fsmt", "mvp", "led", "speecht5"})

SELF, ENCODER, DECODER, CROSS = "self", "encoder", "decoder", "cross"

# The names of the additive score terms a family adds (``LayerAttention.terms`` uses the same words).
RELATIVE_POSITION_BIAS = "relative position bias"
SINK_LOGIT = "sink logit"

# Modules that route attention through the interface but keep no ``scaling`` attribute: the scale their forward
# passes, read from the transformers source (ModernBertAttention.forward: ``scaling=self.head_dim**-0.5``).
_SCALING_FROM_SOURCE = {"ModernBertAttention": lambda module: float(module.head_dim) ** -0.5}

# Forward inputs of models that read no token ids, as the refusal names them.
_NON_TEXT_INPUTS = {
    "input_features": "audio `input_features` (log-mel spectrogram frames)",
    "input_values": "raw audio `input_values`",
    "pixel_values": "images (`pixel_values`)",
}

# Names of cross-attention modules (BART family ``encoder_attn``, T5 ``EncDecAttention``, BERT ``crossattention``).
_CROSS_NAMES = ("cross", "encdec", "encoder_attn")


class KvGrouping:
    """Grouped-query attention's one rule, for a stack and for a model: query head h reads KV head h // groups."""

    num_heads: int
    num_kv_heads: int

    @property
    def kv_groups(self) -> int:
        """Query heads per KV head (1 without grouped-query attention)."""
        return max(1, self.num_heads // self.num_kv_heads)

    def kv_head_of(self, head: int) -> int:
        """The KV head a query head reads (transformers' ``repeat_kv`` layout)."""
        return head // self.kv_groups

    def heads_sharing_kv(self, kv_head: int) -> list[int]:
        """The query heads that read KV head ``kv_head``."""
        return list(range(kv_head * self.kv_groups, (kv_head + 1) * self.kv_groups))


@dataclass(frozen=True)
class StackFacts(KvGrouping):
    """One attention stack: its depth, heads, widths, scale, mask kind and the score terms its family adds."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # value width per head (what a head writes)
    qk_dim: int  # q·k width per head (differs from head_dim for MLA)
    scaling: float
    is_causal: bool
    score_terms: tuple[str, ...]


# ModelFacts fields that are the default stack's own StackFacts field of the same name
_DEFAULT_STACK_FIELDS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "qk_dim", "scaling", "is_causal")


@dataclass(frozen=True)
class ModelFacts(KvGrouping):
    """Architecture facts about a model's attention, read from its config and modules.

    The flat fields of :data:`_DEFAULT_STACK_FIELDS` are the model's default stack's (``"self"``, or ``"encoder"``
    for an encoder–decoder); ``stacks`` holds every stack.
    """

    family: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    scaling: float
    query_prescaled: bool
    is_causal: bool
    positional: str
    rotary_fraction: float | None
    max_positions: int | None
    sliding_window: int | None
    softcap: float | None
    num_parameters: int
    is_language_model: bool
    bos_token_id: int | None
    qk_dim: int  # q·k width per head of the default stack (head_dim except for MLA)
    is_encoder_decoder: bool
    stacks: tuple[StackFacts, ...]
    main_input: str  # what the model's forward reads: "input_ids" (text), or e.g. "input_features" (Whisper audio)

    @property
    def stack_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stacks)

    @property
    def default_stack(self) -> str:
        return ENCODER if self.is_encoder_decoder else SELF

    def require_text_input(self, model_name: str) -> None:
        """Refuse a text tool on a model whose forward reads no token ids (audio features, pixel values)."""
        if self.main_input == "input_ids":
            return
        what = _NON_TEXT_INPUTS.get(self.main_input, f"`{self.main_input}`")
        msg = (
            f"model {model_name!r} ({self.family}) reads {what}, not text: the tools take text (token ids) only. "
            f"Its attention can be captured from Python on given {self.main_input} "
            "(agent_tools.capture.capture_attention); no tool accepts them"
        )
        raise UnsupportedModelError(msg)

    def stack(self, name: str | None = None) -> StackFacts:
        """The facts of one stack (None: the default stack); an unknown name is an error naming the valid ones."""
        name = self.default_stack if name is None else name
        for stack in self.stacks:
            if stack.name == name:
                return stack
        raise _no_stack(self.family, name, self.stack_names)


def _no_stack(family: str, name: str, valid: Iterable[str]) -> InvalidInputError:
    shown = ", ".join(repr(stack) for stack in valid)
    return InvalidInputError(f"this {family} model has no {name!r} attention stack; valid: {shown}", field="attention")


_INTERFACE_CALLERS: dict[type, bool] = {}


def _calls_attention_interface(cls: type) -> bool:
    """Whether a module class's own ``forward`` dispatches through transformers' ``ALL_ATTENTION_FUNCTIONS``."""
    if cls not in _INTERFACE_CALLERS:
        forward = cls.__dict__.get("forward")
        try:
            source = inspect.getsource(forward) if forward is not None else ""
        except (OSError, TypeError):
            source = ""
        _INTERFACE_CALLERS[cls] = "ALL_ATTENTION_FUNCTIONS" in source
    return _INTERFACE_CALLERS[cls]


_ADAPTED_TYPES: dict[type, bool] = {}


def _is_attention_module(module: nn.Module) -> bool:
    cls = type(module)
    if cls not in _ADAPTED_TYPES:  # adapters match by class: look each class up once
        _ADAPTED_TYPES[cls] = adapter_for(module) is not None
    if _ADAPTED_TYPES[cls]:
        return True
    if hasattr(module, "layer_idx") and hasattr(module, "scaling"):
        return True
    return _calls_attention_interface(cls)


def _stack_of(name: str, module: nn.Module, encoder_decoder: bool) -> str:
    lowered = name.lower()
    if getattr(module, "is_cross_attention", False) or any(part in lowered for part in _CROSS_NAMES):
        return CROSS
    if not encoder_decoder:
        return SELF
    for part in name.split("."):
        if part in (ENCODER, DECODER):
            return part
    return SELF


def _family(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))


def _unsupported(model: nn.Module, reason: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"unsupported family {_family(model)!r}: {reason}")


def _layer_order(model: nn.Module, stack: str, named: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    """A stack's modules in layer order: by ``layer_idx`` (or the adapter's layer), else by module order."""
    indices: list[int | None] = []
    for name, module in named:
        adapter = adapter_for(module)
        layer = adapter.layer_index(module, name) if adapter is not None else getattr(module, "layer_idx", None)
        indices.append(layer if isinstance(layer, int) else None)
    if all(index is None for index in indices):
        # DistilBERT: no layer_idx at all; named_modules() walks the layer list in order.
        return [module for _, module in named]
    # Modules without an index next to indexed ones (a vision tower's attention beside a language model's layers)
    # are not this stack's layers: they run uncaptured, with the same eager math.
    named = [pair for pair, index in zip(named, indices, strict=True) if index is not None]
    known = [index for index in indices if index is not None]
    if sorted(known) != list(range(len(named))):
        shown = ", ".join(f"{name}={index}" for (name, _), index in zip(named, known, strict=True))
        reason = (
            f"its {stack!r} attention modules carry layer indices that do not number 0..{len(named) - 1} "
            f"({shown}), as in a hybrid model whose other layers have no attention: the tools number a stack's "
            "layers 0..n-1 and would name these layers wrongly"
        )
        raise _unsupported(model, reason)
    return [module for _, module in sorted(zip(known, (m for _, m in named), strict=True), key=lambda p: p[0])]


def output_head(model: nn.Module) -> nn.Module | None:
    """The unembedding module (None for a model without one)."""
    lookup = getattr(model, "get_output_embeddings", None)
    head = lookup() if callable(lookup) else None
    return head if isinstance(head, nn.Module) else None


def attention_stacks(model: nn.Module) -> dict[str, list[nn.Module]]:
    """Every attention stack of the model, each ordered by layer within the stack.

    Attention modules are the ones that dispatch through transformers' attention interface (they carry
    ``layer_idx`` and ``scaling``, or their forward calls ``ALL_ATTENTION_FUNCTIONS``), or that an adapter in
    :mod:`agent_tools.adapters` routes there. Stacks come in the order encoder, decoder, cross (or self, cross).
    """
    named = [(name, module) for name, module in model.named_modules() if _is_attention_module(module)]
    # Nested attention modules (a wrapper whose child also matches) keep only the innermost ones.
    names = [name for name, _ in named]
    named = [(name, m) for name, m in named if not any(other.startswith(name + ".") for other in names)]
    parts = {part for name, _ in named for part in name.split(".")}
    encoder_decoder = {ENCODER, DECODER} <= parts  # T5EncoderModel, BERT (``encoder.layer``): one stack
    grouped: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in named:
        grouped.setdefault(_stack_of(name, module, encoder_decoder), []).append((name, module))
    if not grouped:
        raise _unsupported(
            model,
            "its attention does not go through transformers' attention interface (no module calls "
            "ALL_ATTENTION_FUNCTIONS or carries layer_idx and scaling, and no adapter covers it), so it cannot be "
            "captured exactly",
        )
    config = getattr(model, "config", None)
    groups, depth = _count(getattr(config, "num_hidden_groups", None)), _count(getattr(config, "num_hidden_layers", 0))
    if groups is not None and depth is not None and len(named) < depth:
        reason = (
            f"it shares one attention module between layers ({len(named)} module(s) for {depth} layers, "
            f"num_hidden_groups={groups}, as in ALBERT): capture cannot tell those layers apart"
        )
        raise _unsupported(model, reason)
    order = (ENCODER, DECODER, SELF, CROSS)
    return {stack: _layer_order(model, stack, grouped[stack]) for stack in order if stack in grouped}


def default_stack_name(stacks: dict[str, list[nn.Module]]) -> str:
    """``"encoder"`` for an encoder–decoder, else ``"self"`` (or the only stack there is)."""
    for name in (ENCODER, SELF):
        if name in stacks:
            return name
    return next(iter(stacks))


def find_attention_modules(model: nn.Module, stack: str | None = None) -> list[nn.Module]:
    """One stack's attention modules in layer order (None: the default stack)."""
    stacks = attention_stacks(model)
    name = default_stack_name(stacks) if stack is None else stack
    if name not in stacks:
        raise _no_stack(_family(model), name, stacks)
    return stacks[name]


def _first(config: object, *names: str) -> object | None:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _positional_scheme(model: nn.Module, config: object, terms: tuple[str, ...]) -> tuple[str, float | None]:
    if ALIBI in terms:  # BLOOM, MPT, Falcon-ALiBi (their adapters name the term)
        return "ALiBi (linear bias on scores)", None
    if DISENTANGLED in terms:
        return "relative positions as disentangled content→position and position→content score terms", None
    names = [name for name, _ in model.named_modules()]
    has_rotary = any(name.endswith(("rotary_emb", "rotary")) for name in names)
    if getattr(config, "position_embedding_type", None) == "rotary":
        has_rotary = True
    if has_rotary:
        fraction = _first(config, "rotary_pct", "partial_rotary_factor")
        rope = getattr(config, "rope_parameters", None) or {}
        if fraction is None and isinstance(rope, dict):
            fraction = rope.get("partial_rotary_factor")
        rope_dims, nope_dims = _count(getattr(config, "qk_rope_head_dim", None)), getattr(config, "qk_nope_head_dim", 0)
        if fraction is None and rope_dims and isinstance(nope_dims, int):  # MLA: RoPE on the qk_rope part only
            fraction = rope_dims / (rope_dims + nope_dims)
        fraction = float(fraction) if isinstance(fraction, numbers.Real) else 1.0
        label = "rotary (RoPE)" if fraction >= 1.0 else f"rotary (RoPE) on {fraction:.0%} of each head's dims"
        return label, fraction
    if getattr(config, "alibi", False) or getattr(config, "use_alibi", False):
        return "ALiBi (linear bias on scores)", None
    if any(name.endswith("relative_attention_bias") for name in names):
        return "relative position bias (bucketed distances, a learned per-head term added to the scores)", None
    absolute = [m for n, m in model.named_modules() if n.endswith(("wpe", "position_embeddings", "embed_positions"))]
    if absolute and all("Sinusoidal" in type(m).__name__ for m in absolute):  # Marian, Pegasus
        return "fixed sinusoidal absolute position embeddings added to the input", None
    if absolute:
        return "learned absolute position embeddings added to the input", None
    return "none detected", None


def _main_input(model: nn.Module) -> str:
    """The input a model's forward reads first: ``input_ids`` for text models, else its non-text input."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "input_ids"
    if "input_ids" in parameters:
        return "input_ids"
    return next((name for name in _NON_TEXT_INPUTS if name in parameters), "input_ids")


def _count(value: object) -> int | None:
    """A config or module number as an int; None when absent or 0 (transformers' "not set")."""
    return int(float(value)) if isinstance(value, numbers.Real) and value else None


def _required_count(config: object, *names: str) -> int:
    count = _count(_first(config, *names))
    if count is None:
        msg = f"the model's config has none of {', '.join(names)}: cannot tell its attention's shape"
        raise UnsupportedModelError(msg)
    return count


def _module_scaling(module: nn.Module, adapter: FamilyAdapter | None) -> float:
    if adapter is not None:
        return float(adapter.scaling(module))
    scaling = getattr(module, "scaling", None)
    if scaling is None and type(module).__name__ in _SCALING_FROM_SOURCE:
        scaling = _SCALING_FROM_SOURCE[type(module).__name__](module)
    if not isinstance(scaling, numbers.Real):
        msg = (
            f"{type(module).__name__} passes its scale to the attention function without keeping it as a "
            f"`scaling` number ({scaling!r}), so the model's scale cannot be stated"
        )
        raise UnsupportedModelError(msg)
    return float(scaling)


def _score_terms(module: nn.Module, stack: str, adapter: FamilyAdapter | None) -> tuple[str, ...]:
    if adapter is not None:
        return tuple(adapter.score_terms(module))
    terms: list[str] = []
    if hasattr(module, "relative_attention_num_buckets") and stack != CROSS:
        terms.append(RELATIVE_POSITION_BIAS)  # T5 family: cross-attention gets a zero bias
    if isinstance(getattr(module, "sinks", None), nn.Parameter):
        terms.append(SINK_LOGIT)
    return tuple(terms)


def _stack_facts(stack: str, modules: list[nn.Module], config: object, family: str) -> StackFacts:
    first = modules[0]
    config = getattr(first, "config", None) or config  # a multimodal model's text layers read the text config
    adapter = adapter_for(first)
    num_heads = _count(_first(first, "num_heads", "n_heads", "num_attention_heads")) or _required_count(
        config, "num_attention_heads", "n_head", "num_heads"
    )
    groups = _count(getattr(first, "num_key_value_groups", None))
    num_kv_heads = (
        _count(_first(first, "num_key_value_heads", "num_kv_heads"))  # Falcon's: 1 multi-query, else the config's
        or (num_heads // groups if groups else None)
        or _count(_first(config, "num_key_value_heads", "multi_query_group_num"))
        or num_heads
    )
    hidden = _required_count(config, "hidden_size", "n_embd", "d_model")
    module_dim = _count(
        _first(first, "v_head_dim", "head_dim", "head_size", "attention_head_size", "key_value_proj_dim")
    )
    head_dim = module_dim or _count(_first(config, "v_head_dim", "head_dim")) or hidden // num_heads
    qk_dim = _count(_first(first, "qk_head_dim")) or _count(getattr(config, "qk_head_dim", None)) or head_dim
    if stack in (ENCODER, CROSS):
        is_causal = False
    elif stack == DECODER:
        is_causal = True
    else:
        is_causal = bool(getattr(first, "is_causal", True)) and not getattr(config, "is_encoder_only", False)
        if family in {"bert", "roberta", "distilbert", "electra", "xlm-roberta", "deberta", "deberta-v2"}:
            is_causal = bool(getattr(config, "is_decoder", False))
    return StackFacts(
        name=stack,
        num_layers=len(modules),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        qk_dim=qk_dim,
        scaling=_module_scaling(first, adapter),
        is_causal=is_causal,
        score_terms=_score_terms(first, stack, adapter),
    )


def read_facts(model: nn.Module) -> ModelFacts:
    """The facts of a loaded model; the only place that reads its config."""
    config: object = getattr(model, "config", None)
    family = _family(model)
    stacks = attention_stacks(model)
    facts = tuple(_stack_facts(name, modules, config, family) for name, modules in stacks.items())
    main = next(s for s in facts if s.name == default_stack_name(stacks))
    main_config = getattr(stacks[default_stack_name(stacks)][0], "config", None) or config
    hidden = _required_count(main_config, "hidden_size", "n_embd", "d_model")
    positional, fraction = _positional_scheme(model, main_config, main.score_terms)
    softcap = getattr(config, "attn_logit_softcapping", None)
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    is_lm = hasattr(model, "lm_head") or type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    return ModelFacts(
        **{name: getattr(main, name) for name in _DEFAULT_STACK_FIELDS},
        family=family,
        architecture=str(architectures[0]),
        hidden_size=hidden,
        query_prescaled=family in QUERY_PRESCALED_FAMILIES,
        positional=positional,
        rotary_fraction=fraction,
        max_positions=_count(_first(config, "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")),
        sliding_window=_count(getattr(config, "sliding_window", None)),
        softcap=float(softcap) if softcap else None,
        num_parameters=sum(p.numel() for p in model.parameters()),
        is_language_model=is_lm,
        bos_token_id=getattr(config, "bos_token_id", None),
        is_encoder_decoder=ENCODER in stacks and DECODER in stacks,
        stacks=facts,
        main_input=_main_input(model),
    )
