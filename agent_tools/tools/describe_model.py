"""describe_model: what is this model's attention?"""

from __future__ import annotations

import math

from pydantic import Field

from agent_tools.inspector import Inspector
from agent_tools.schemas import Finding, ModelInput, Report, rounded
from agent_tools.tools.registry import ToolSpec


class DescribeModelInput(ModelInput):
    """Arguments of describe_model."""


class ModelDescription(Report):
    family: str = Field(description="transformers model_type, e.g. llama, bert")
    architecture: str
    num_layers: int
    num_heads: int = Field(description="query heads per layer")
    num_kv_heads: int = Field(description="key/value heads per layer (fewer than num_heads = grouped-query attention)")
    kv_groups: int = Field(description="query heads sharing each KV head")
    head_dim: int = Field(description="d_k: dimensions per head")
    hidden_size: int
    scaling: float = Field(description="the factor the model multiplies q·k by")
    inverse_sqrt_head_dim: float = Field(description="1/sqrt(head_dim) for comparison")
    scaling_ratio: float = Field(description="scaling · sqrt(head_dim): 1.0 means the standard 1/sqrt(d_k)")
    query_prescaled: bool = Field(description="the scale is folded into the query projection (e.g. OPT)")
    positional: str = Field(description="how positions enter attention")
    causal: bool = Field(description="True: each token reads only earlier tokens (decoder); False: bidirectional")
    mask: str
    max_positions: int | None
    sliding_window: int | None
    softcap: float | None = Field(description="attention logit soft-capping: scores = c·tanh(scores/c)")
    num_parameters: int
    language_model: bool = Field(description="has a next-token head (ablation reports KL of the next token)")


def describe_model(inspector: Inspector, args: DescribeModelInput) -> ModelDescription:
    """Describe the model's attention: family, layers, heads, KV heads, head_dim, scale, positions, mask."""
    loaded = inspector.model(args.model)
    f = loaded.facts
    inverse = 1 / math.sqrt(f.head_dim)
    ratio = f.scaling * math.sqrt(f.head_dim)
    mask = (
        "causal (each query reads itself and earlier tokens)"
        if f.is_causal
        else "bidirectional (every token reads every token)"
    )
    if f.sliding_window:
        mask += f", sliding window of {f.sliding_window} tokens on the layers that use it"
    mask += "; padding keys masked"
    findings = []
    if abs(ratio - 1) > 1e-3:
        findings.append(
            Finding(
                kind="nonstandard_scale",
                value=rounded(ratio),
                detail=f"scale {f.scaling:.4g} is {ratio:.3g}× the standard 1/sqrt({f.head_dim}) = {inverse:.4g}",
            )
        )
    if f.num_kv_heads < f.num_heads:
        findings.append(
            Finding(
                kind="grouped_query_attention",
                value=float(f.kv_groups),
                detail=(
                    f"{f.num_heads} query heads share {f.num_kv_heads} KV heads ({f.kv_groups} query heads per KV head)"
                ),
            )
        )
    if f.softcap:
        findings.append(Finding(kind="softcap", value=f.softcap, detail=f"scores are soft-capped at ±{f.softcap}"))
    scale_note = "= 1/sqrt(d_k)" if abs(ratio - 1) <= 1e-3 else f"{ratio:.3g}× 1/sqrt(d_k)"
    summary = (
        f"{loaded.name} is a {f.family} {'decoder' if f.is_causal else 'encoder'} with {f.num_layers} layers × "
        f"{f.num_heads} heads (head_dim {f.head_dim}, {f.num_kv_heads} KV heads), "
        f"{f.num_parameters / 1e6:.0f}M parameters. "
        f"Scores are q·k × {f.scaling:.4g} ({scale_note}); "
        f"positions: {f.positional}; mask: {'causal' if f.is_causal else 'bidirectional'}."
    )
    return ModelDescription(
        model=loaded.name,
        summary=summary,
        findings=findings,
        family=f.family,
        architecture=f.architecture,
        num_layers=f.num_layers,
        num_heads=f.num_heads,
        num_kv_heads=f.num_kv_heads,
        kv_groups=f.kv_groups,
        head_dim=f.head_dim,
        hidden_size=f.hidden_size,
        scaling=rounded(f.scaling, 6),
        inverse_sqrt_head_dim=rounded(inverse, 6),
        scaling_ratio=rounded(ratio),
        query_prescaled=f.query_prescaled,
        positional=f.positional,
        causal=f.is_causal,
        mask=mask,
        max_positions=f.max_positions,
        sliding_window=f.sliding_window,
        softcap=f.softcap,
        num_parameters=f.num_parameters,
        language_model=f.is_language_model,
    )


SPEC = ToolSpec(
    name="describe_model",
    description=(
        "Describe a transformer's attention: family, number of layers and heads, KV heads (grouped-query), "
        "head_dim, the score scale and how it compares with 1/sqrt(d_k), positional scheme, causal or "
        "bidirectional mask, maximum positions and parameter count. Call this first to learn valid layer/head ranges."
    ),
    input_model=DescribeModelInput,
    output_model=ModelDescription,
    run=describe_model,
    example={},
)
