"""describe_model's work: no forward pass, only the model's facts and its score scale."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from agent_tools.families import ModelFacts, StackFacts, read_facts
from agent_tools.inspector import Inspector
from agent_tools.loading import cached_model, resolve_reference, source_config, unreadable_folder
from agent_tools.placement import (
    cache_key,
    dtype_name,
    dtype_reason,
    estimate_memory,
    meta_model,
    resolve_device,
    resolve_dtype,
    weights_bytes,
)
from agent_tools.runner.paths import EXPLAINED_PATH
from agent_tools.schemas import AttentionPath
from agent_tools.tools.describe_model.models import (
    DescribeModelInput,
    MemoryNeeds,
    ModelDescription,
    StackDescription,
)
from agent_tools.tools.describe_model.narrative import findings, mask_text, scale_ratio, summary

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
FACT_FIELDS = (  # ModelFacts read into the report under the same name
    "family", "architecture", "num_layers", "num_heads", "num_kv_heads", "kv_groups", "head_dim", "hidden_size",
    "scaling", "query_prescaled", "positional", "max_positions", "sliding_window", "softcap", "num_parameters",
)  # fmt: skip


def stack_description(stack: StackFacts) -> StackDescription:
    """One stack's facts as the report states them (built from the :class:`StackFacts` fields)."""
    ratio = scale_ratio(stack)
    return StackDescription.model_validate(asdict(stack) | {"scaling_ratio": ratio, "causal": stack.is_causal})


@dataclass(frozen=True)
class _Described:
    """What describe_model reads: a loaded model, or a config's model built on the meta device (no weights)."""

    name: str
    model: nn.Module
    facts: ModelFacts
    dtype: torch.dtype
    device: str
    loaded: bool
    config: object
    folder: Path | None


def _described(inspector: Inspector, reference: str | None) -> _Described:
    """The model already in memory under this session's placement; else its config on the meta device."""
    name = inspector.policy.check(reference)
    placement = inspector.placement
    in_memory = inspector.served(name)
    if in_memory is None:
        in_memory = cached_model(name, cache_key(placement))
    if in_memory is not None:
        loaded = inspector.model(name)  # a cache hit: marks it served, reads nothing
        return _Described(
            loaded.name, loaded.model, loaded.facts, loaded.dtype, str(loaded.device), True,
            getattr(loaded.model, "config", None), loaded.source.path if loaded.source.kind == "folder" else None,
        )  # fmt: skip
    source = resolve_reference(name)
    config = source_config(source)
    try:
        model = meta_model(config)
        facts = read_facts(model)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise unreadable_folder(source, exc) from exc
    dtype = resolve_dtype(placement, config)
    device = resolve_device(placement) if placement.device_map is None else "auto"
    folder = source.path if source.kind == "folder" else None
    return _Described(source.alias or source.reference, model, facts, dtype, device, False, config, folder)


def memory_needs(described: _Described, inspector: Inspector) -> MemoryNeeds | None:
    """The operator's placement's memory estimate for this model (from the config; None without one)."""
    if described.config is None or not hasattr(described.config, "to_dict"):
        return None
    estimate = estimate_memory(
        described.config, described.dtype, quantization=inspector.placement.quantization, folder=described.folder
    )
    return MemoryNeeds(
        dtype=dtype_name(described.dtype),
        weights_bytes=estimate.weights,
        load_copy_bytes=estimate.load_copy,
        working_set_bytes=estimate.working_set,
        working_set_tokens=estimate.tokens,
        peak_bytes=estimate.peak,
    )


def describe_model(inspector: Inspector, args: DescribeModelInput) -> ModelDescription:
    """Describe the model's attention: family, layers, heads, KV heads, head_dim, scale, positions, mask.

    A model not yet loaded is described from its config on the meta device: no weight is read, so a model that
    does not fit (or a folder holding only a config) is described, with the memory its load would need.
    """
    described = _described(inspector, args.model)
    f = described.facts
    stacks = [stack_description(stack) for stack in f.stacks]
    said = summary(described.name, f)
    if f.is_encoder_decoder:
        said += (
            " Attention stacks (attention=): "
            + "; ".join(
                f"{s.name} {s.num_layers} layers × {s.num_heads} heads"
                + (f" + {', '.join(s.score_terms)}" if s.score_terms else "")
                for s in stacks
            )
            + "."
        )
    if not described.loaded:
        said += " Described from its config (no weights loaded)."
    return ModelDescription(
        model=described.name,
        dtype=dtype_name(described.dtype),
        device=described.device,
        attention_path=AttentionPath(
            explained=EXPLAINED_PATH, model_default=str(getattr(described.config, "_attn_implementation", "eager"))
        ),
        summary=said,
        findings=findings(f),
        **{name: getattr(f, name) for name in FACT_FIELDS},
        inverse_sqrt_head_dim=1 / math.sqrt(f.qk_dim),
        scaling_ratio=scale_ratio(f),
        causal=f.is_causal,
        mask=mask_text(f),
        language_model=f.is_language_model,
        placement=cache_key(inspector.placement),
        dtype_reason=dtype_reason(inspector.placement, described.config),
        stacks=stacks,
        weights_bytes={name: weights_bytes(described.model, getattr(torch, name)) for name in FLOAT_DTYPES},
        weights_loaded=described.loaded,
        memory=memory_needs(described, inspector),
    )
