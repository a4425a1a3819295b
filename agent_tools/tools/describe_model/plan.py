"""describe_model's work: no forward pass, only the model's facts and its score scale."""

from __future__ import annotations

import math

import torch

from agent_tools.families import ModelFacts, StackFacts
from agent_tools.inspector import Inspector
from agent_tools.placement import cache_key, weights_bytes
from agent_tools.schemas import rounded
from agent_tools.tools.describe_model.models import DescribeModelInput, ModelDescription, StackDescription
from agent_tools.tools.describe_model.narrative import Scale, findings, mask_text, summary

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def attention_scale(facts: ModelFacts) -> Scale:
    """The model's q·k factor against 1/sqrt(d_k), d_k the q·k width (head_dim except for MLA)."""
    return Scale(
        scaling=facts.scaling,
        inverse_sqrt_head_dim=1 / math.sqrt(facts.qk_dim),
        ratio=facts.scaling * math.sqrt(facts.qk_dim),
    )


def stack_description(stack: StackFacts) -> StackDescription:
    """One stack's facts as the report states them."""
    return StackDescription(
        name=stack.name,
        num_layers=stack.num_layers,
        num_heads=stack.num_heads,
        num_kv_heads=stack.num_kv_heads,
        head_dim=stack.head_dim,
        qk_dim=stack.qk_dim,
        scaling=rounded(stack.scaling, 6),
        scaling_ratio=rounded(stack.scaling * math.sqrt(stack.qk_dim)),
        causal=stack.is_causal,
        score_terms=list(stack.score_terms),
    )


def describe_model(inspector: Inspector, args: DescribeModelInput) -> ModelDescription:
    """Describe the model's attention: family, layers, heads, KV heads, head_dim, scale, positions, mask."""
    loaded = inspector.model(args.model)
    f = loaded.facts
    scale = attention_scale(f)
    stacks = [stack_description(stack) for stack in f.stacks]
    said = summary(loaded.name, f, scale)
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
    return ModelDescription(
        model=loaded.name,
        summary=said,
        findings=findings(f, scale),
        family=f.family,
        architecture=f.architecture,
        num_layers=f.num_layers,
        num_heads=f.num_heads,
        num_kv_heads=f.num_kv_heads,
        kv_groups=f.kv_groups,
        head_dim=f.head_dim,
        hidden_size=f.hidden_size,
        scaling=rounded(f.scaling, 6),
        inverse_sqrt_head_dim=rounded(scale.inverse_sqrt_head_dim, 6),
        scaling_ratio=rounded(scale.ratio),
        query_prescaled=f.query_prescaled,
        positional=f.positional,
        causal=f.is_causal,
        mask=mask_text(f),
        max_positions=f.max_positions,
        sliding_window=f.sliding_window,
        softcap=f.softcap,
        num_parameters=f.num_parameters,
        language_model=f.is_language_model,
        placement=cache_key(loaded.placement),
        stacks=stacks,
        weights_bytes={name: weights_bytes(loaded.model, getattr(torch, name)) for name in FLOAT_DTYPES},
    )
