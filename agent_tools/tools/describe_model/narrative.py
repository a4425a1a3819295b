"""describe_model's words: the mask, the findings and the summary, from the model's facts and its score scale."""

from __future__ import annotations

import math

from agent_tools.families import ModelFacts, StackFacts
from agent_tools.schemas import Finding, NextCall, follow_up, rounded
from agent_tools.tools.describe_model.models import DescribeModelInput, ModelDescription
from agent_tools.wording import SAMPLE_TEXT, is_standard_scale, scale_phrase


def scale_ratio(facts: ModelFacts | StackFacts) -> float:
    """A model's (or stack's) scaling · sqrt(d_k), d_k the q·k width (head_dim except for MLA): 1.0 is standard."""
    return facts.scaling * math.sqrt(facts.qk_dim)


def mask_text(facts: ModelFacts) -> str:
    """Which keys a query reads: causal or bidirectional, a sliding window, padding."""
    mask = (
        "causal (each query reads itself and earlier tokens)"
        if facts.is_causal
        else "bidirectional (every token reads every token)"
    )
    if facts.sliding_window:
        mask += f", sliding window of {facts.sliding_window} tokens on the layers that use it"
    return mask + "; padding keys masked"


def findings(facts: ModelFacts) -> list[Finding]:
    """What is unusual about the attention: a non-standard scale, grouped-query attention, soft-capping."""
    found, ratio = [], scale_ratio(facts)
    if not is_standard_scale(ratio):
        found.append(
            Finding(
                kind="nonstandard_scale",
                value=rounded(ratio),
                detail=f"scale {facts.scaling:.4g} is {ratio:.3g}× the standard 1/sqrt({facts.qk_dim}) = "
                f"{1 / math.sqrt(facts.qk_dim):.4g}",
            )
        )
    if facts.num_kv_heads < facts.num_heads:
        found.append(
            Finding(
                kind="grouped_query_attention",
                value=float(facts.kv_groups),
                detail=f"{facts.num_heads} query heads share {facts.num_kv_heads} KV heads ({facts.kv_groups} query "
                "heads per KV head)",
            )
        )
    if facts.softcap:
        found.append(Finding(kind="softcap", value=facts.softcap, detail=f"scores are soft-capped at ±{facts.softcap}"))
    return found


def summary(name: str, facts: ModelFacts) -> str:
    """One paragraph: kind, size, scale, positions, mask."""
    kind = f"{'decoder' if facts.is_causal else 'encoder'} with"
    if facts.is_encoder_decoder:
        kind = "encoder–decoder whose encoder has"
    return (
        f"{name} is a {facts.family} {kind} {facts.num_layers} layers × "
        f"{facts.num_heads} heads (head_dim {facts.head_dim}, {facts.num_kv_heads} KV heads), "
        f"{facts.num_parameters / 1e6:.0f}M parameters. "
        f"Scores are q·k × {facts.scaling:.4g} ({scale_phrase(scale_ratio(facts))}); "
        f"positions: {facts.positional}; mask: {'causal' if facts.is_causal else 'bidirectional'}."
    )


def next_calls(args: DescribeModelInput, report: ModelDescription) -> list[NextCall]:
    """First looks at this model's heads: which collapse, what each does, and one map of the last layer."""
    heads = report.num_layers * report.num_heads
    return [
        follow_up(
            "diagnose_collapse",
            {"text": SAMPLE_TEXT},
            f"which of the {heads} heads collapse, and whether it is harmless",
            model=args.model,
        ),
        follow_up("profile_heads", {"layers": [0, 1, 2]}, "what the first layers' heads do (roles)", model=args.model),
        follow_up(
            "show_attention",
            {"text": SAMPLE_TEXT, "layer": report.num_layers - 1, "head": 0},
            f"one map of the last layer (layers 0..{report.num_layers - 1}, heads 0..{report.num_heads - 1})",
            model=args.model,
        ),
    ]
