"""What a model's attention *is*: find its attention modules and read the facts that explain it.

Pure inspection of an instantiated model; no forward pass, no hooks.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from torch import nn

from agent_tools.errors import UnsupportedModelError

# Families whose attention module multiplies the query by the scale inside its projection step and then
# passes ``scaling=1.0`` to the attention function (so captured queries are already scaled).
QUERY_PRESCALED_FAMILIES = frozenset({"opt", "bart", "mbart", "marian", "pegasus", "blenderbot", "m2m_100"})


@dataclass(frozen=True)
class ModelFacts:
    """Architecture facts about a model's attention, read from its config and modules."""

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

    @property
    def kv_groups(self) -> int:
        """Query heads per KV head (1 without grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def kv_head_of(self, head: int) -> int:
        """The KV head a query head reads (transformers' ``repeat_kv`` layout)."""
        return head // self.kv_groups

    def heads_sharing_kv(self, kv_head: int) -> list[int]:
        return list(range(kv_head * self.kv_groups, (kv_head + 1) * self.kv_groups))


def find_attention_modules(model: nn.Module) -> list[nn.Module]:
    """Self-attention modules ordered by ``layer_idx``.

    Every family that routes attention through transformers' ``ALL_ATTENTION_FUNCTIONS`` has modules that
    carry ``layer_idx`` and ``scaling``; cross-attention modules are skipped.
    """
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "layer_idx") and hasattr(module, "scaling")):
            continue
        if "cross" in name.lower() or getattr(module, "is_cross_attention", False):
            continue
        layer = module.layer_idx
        if not isinstance(layer, int) or layer in found:
            continue
        found[layer] = module
    if not found or sorted(found) != list(range(len(found))):
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        msg = (
            f"unsupported family {family!r}: its attention does not go through transformers' attention "
            "interface (no modules with layer_idx and scaling), so it cannot be captured exactly"
        )
        raise UnsupportedModelError(msg)
    return [found[i] for i in range(len(found))]


def _first(config: object, *names: str) -> object | None:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _positional_scheme(model: nn.Module, config: object) -> tuple[str, float | None]:
    names = [name for name, _ in model.named_modules()]
    has_rotary = any(name.endswith(("rotary_emb", "rotary")) for name in names)
    if getattr(config, "position_embedding_type", None) == "rotary":
        has_rotary = True
    if has_rotary:
        fraction = _first(config, "rotary_pct", "partial_rotary_factor")
        rope = getattr(config, "rope_parameters", None) or {}
        if fraction is None and isinstance(rope, dict):
            fraction = rope.get("partial_rotary_factor")
        fraction = float(fraction) if isinstance(fraction, numbers.Real) else 1.0
        label = "rotary (RoPE)" if fraction >= 1.0 else f"rotary (RoPE) on {fraction:.0%} of each head's dims"
        return label, fraction
    if getattr(config, "alibi", False) or getattr(config, "use_alibi", False):
        return "ALiBi (linear bias on scores)", None
    if any(name.endswith(("wpe", "position_embeddings", "embed_positions")) for name in names):
        return "learned absolute position embeddings added to the input", None
    return "none detected", None


def _count(value: object) -> int | None:
    """A config or module number as an int; None when absent or 0 (transformers' "not set")."""
    return int(float(value)) if isinstance(value, numbers.Real) and value else None


def _required_count(config: object, *names: str) -> int:
    count = _count(_first(config, *names))
    if count is None:
        msg = f"the model's config has none of {', '.join(names)}: cannot tell its attention's shape"
        raise UnsupportedModelError(msg)
    return count


def read_facts(model: nn.Module) -> ModelFacts:
    """The facts of a loaded model; the only place that reads its config."""
    config: object = getattr(model, "config", None)
    family = str(getattr(config, "model_type", type(model).__name__))
    modules = find_attention_modules(model)
    first = modules[0]
    num_heads = _required_count(config, "num_attention_heads", "n_head", "num_heads")
    num_kv_heads = _count(_first(config, "num_key_value_heads", "multi_query_group_num")) or num_heads
    hidden = _required_count(config, "hidden_size", "n_embd", "d_model")
    module_head_dim = _count(_first(first, "head_dim", "head_size", "attention_head_size"))
    head_dim = module_head_dim or _count(_first(config, "head_dim")) or hidden // num_heads
    scaling = getattr(first, "scaling", None)
    if not isinstance(scaling, numbers.Real):
        raise UnsupportedModelError(f"{type(first).__name__}.scaling is not a number: {scaling!r}")
    positional, fraction = _positional_scheme(model, config)
    softcap = getattr(config, "attn_logit_softcapping", None)
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    is_lm = hasattr(model, "lm_head") or type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    is_causal = bool(getattr(first, "is_causal", True)) and not getattr(config, "is_encoder_only", False)
    if family in {"bert", "roberta", "distilbert", "electra", "xlm-roberta", "deberta"}:
        is_causal = bool(getattr(config, "is_decoder", False))
    return ModelFacts(
        family=family,
        architecture=str(architectures[0]),
        num_layers=len(modules),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        scaling=float(scaling),
        query_prescaled=family in QUERY_PRESCALED_FAMILIES,
        is_causal=is_causal,
        positional=positional,
        rotary_fraction=fraction,
        max_positions=_count(_first(config, "max_position_embeddings", "n_positions", "n_ctx")),
        sliding_window=_count(getattr(config, "sliding_window", None)),
        softcap=float(softcap) if softcap else None,
        num_parameters=sum(p.numel() for p in model.parameters()),
        is_language_model=is_lm,
        bos_token_id=getattr(config, "bos_token_id", None),
    )
