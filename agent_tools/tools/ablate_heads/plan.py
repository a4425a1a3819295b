"""ablate_heads' pass: clean and ablated forwards through the inspector, then the effect sizes on the output."""

from __future__ import annotations

import torch

from agent_tools.analysis.ablation import cosine_change
from agent_tools.analysis.metrics import kl_divergence, next_token_losses
from agent_tools.inspector import Encoded, Inspector
from agent_tools.loading import LoadedModel
from agent_tools.runner import AblationEffect
from agent_tools.schemas import head_label, rounded
from agent_tools.tools.ablate_heads.models import AblateHeadsInput, AblationReport, PositionEffect, parse_heads
from agent_tools.tools.ablate_heads.narrative import (
    Ablated,
    EmbeddingEffect,
    NextTokenEffect,
    embedding_findings,
    embedding_summary,
    next_token_findings,
    next_token_summary,
)


def ablate_heads(inspector: Inspector, args: AblateHeadsInput) -> AblationReport:
    """Remove the named heads' contribution and report how the model's output changes on the text."""
    loaded = inspector.model(args.model)
    facts = loaded.facts
    heads = parse_heads(args.heads, facts.num_layers, facts.num_heads)
    encoded = inspector.encode(loaded, args.text)
    effect = inspector.ablate(loaded, encoded.input_ids, encoded.attention_mask, heads, method=args.method)
    ablated = Ablated(
        heads=[head_label(layer, head) for layer, head in heads], method=args.method, tokens=encoded.length
    )
    if effect.language_model:
        return _next_token_report(loaded, encoded, effect, ablated, args)
    return _embedding_report(loaded, encoded, effect, ablated, args)


def _largest(values: list[float], order: list[int], encoded: Encoded) -> list[PositionEffect]:
    """The per-position effects at ``order`` (the largest first), rounded for reading."""
    return [PositionEffect(position=p, token=encoded.tokens[p].text, value=rounded(values[p], 6)) for p in order]


def _decode(loaded: LoadedModel, token_id: int) -> str:
    return str(loaded.tokenizer.decode([token_id]))


def _next_token_effect(
    loaded: LoadedModel, encoded: Encoded, effect: AblationEffect, kl_values: list[float], peak: int
) -> NextTokenEffect:
    """The KL summary (per-position ``kl_values``, largest at ``peak``), the top next token clean vs ablated,
    and the loss on the text."""
    clean_probs = torch.softmax(effect.clean[0, -1].double(), -1)  # (V,)
    ablated_probs = torch.softmax(effect.ablated[0, -1].double(), -1)  # (V,)
    top_clean, top_ablated = int(clean_probs.argmax()), int(ablated_probs.argmax())
    loss_clean = loss_ablated = None
    if encoded.length > 1:
        loss_clean = float(next_token_losses(effect.clean, encoded.input_ids).mean())
        loss_ablated = float(next_token_losses(effect.ablated, encoded.input_ids).mean())
    return NextTokenEffect(
        kl_last=kl_values[-1],
        kl_mean=sum(kl_values) / len(kl_values),
        peak_position=peak,
        peak_token=encoded.tokens[peak].text,
        kl_peak=kl_values[peak],
        top_clean=_decode(loaded, top_clean),
        top_ablated=_decode(loaded, top_ablated),
        top_changed=top_clean != top_ablated,
        p_clean=float(clean_probs[top_clean]),
        p_ablated=float(ablated_probs[top_clean]),
        loss_clean=loss_clean,
        loss_ablated=loss_ablated,
    )


def _next_token_report(
    loaded: LoadedModel, encoded: Encoded, effect: AblationEffect, ablated: Ablated, args: AblateHeadsInput
) -> AblationReport:
    """A causal LM's report: KL of the next-token distribution, loss on the text, top next token."""
    kl = kl_divergence(effect.clean[0], effect.ablated[0])  # (T,)
    kl_values: list[float] = kl.tolist()
    order: list[int] = kl.argsort(descending=True)[: args.top_k].tolist()
    numbers = _next_token_effect(loaded, encoded, effect, kl_values, order[0])
    largest = _largest(kl_values, order, encoded)
    return AblationReport(
        model=loaded.name,
        summary=next_token_summary(ablated, numbers),
        findings=next_token_findings(largest),
        heads=list(ablated.heads),
        method=args.method,
        measure="next_token",
        tokens=encoded.length,
        kl_last_position=rounded(numbers.kl_last, 6),
        kl_mean=rounded(numbers.kl_mean, 6),
        loss_clean=rounded(numbers.loss_clean) if numbers.loss_clean is not None else None,
        loss_ablated=rounded(numbers.loss_ablated) if numbers.loss_ablated is not None else None,
        loss_change=rounded(numbers.loss_change, 6) if numbers.loss_change is not None else None,
        top_token_clean=numbers.top_clean,
        top_token_ablated=numbers.top_ablated,
        top_token_changed=numbers.top_changed,
        top_token_probability_clean=rounded(numbers.p_clean),
        top_token_probability_ablated=rounded(numbers.p_ablated),
        largest_effects=largest,
    )


def _embedding_report(
    loaded: LoadedModel, encoded: Encoded, effect: AblationEffect, ablated: Ablated, args: AblateHeadsInput
) -> AblationReport:
    """An encoder's report: how far the pooled and the per-token output embeddings turn (1 − cos)."""
    per_token = cosine_change(effect.clean[0], effect.ablated[0])  # (T,)
    values: list[float] = per_token.tolist()
    order: list[int] = per_token.argsort(descending=True)[: args.top_k].tolist()
    peak = order[0]
    numbers = EmbeddingEffect(
        pooled=float(cosine_change(effect.clean[0].mean(0), effect.ablated[0].mean(0))),
        mean=sum(values) / len(values),
        peak_position=peak,
        peak_token=encoded.tokens[peak].text,
        peak=values[peak],
    )
    largest = _largest(values, order, encoded)
    return AblationReport(
        model=loaded.name,
        summary=embedding_summary(ablated, numbers),
        findings=embedding_findings(largest),
        heads=list(ablated.heads),
        method=args.method,
        measure="embedding",
        tokens=encoded.length,
        pooled_cosine_change=rounded(numbers.pooled, 6),
        mean_token_cosine_change=rounded(numbers.mean, 6),
        largest_effects=largest,
    )
