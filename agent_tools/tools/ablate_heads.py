"""ablate_heads: does a head matter? The change in the model's output when the named heads are removed."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from agent_tools.analysis.ablation import cosine_change, next_token_kl, token_losses
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Encoded, Inspector, check_index
from agent_tools.intervene import AblationMethod, group_heads, heads_ablated, recorded_head_means
from agent_tools.loading import LoadedModel
from agent_tools.schemas import Finding, Report, TextInput, rounded
from agent_tools.tools.registry import ToolSpec

_HEAD_STRING = re.compile(r"^\s*[Ll]?\s*(-?\d+)\s*(?:\.|:|[Hh]|\.[Hh])\s*(-?\d+|\*)\s*$")


class HeadRef(BaseModel):
    """One attention head: layer and query head, both 0-based."""

    model_config = ConfigDict(extra="forbid")

    layer: int = Field(description="layer index, 0-based")
    head: int = Field(description="query head index, 0-based")


HEADS_DESCRIPTION = (
    'heads to remove, as "L.H" strings (e.g. "3.0" = layer 3 head 0; "L3H0" also works; "3.*" = every head of layer '
    '3) or {"layer": 3, "head": 0} objects; each at most once'
)


class AblateHeadsInput(TextInput):
    heads: list[str | HeadRef] = Field(min_length=1, description=HEADS_DESCRIPTION)
    method: AblationMethod = Field(
        default="zero",
        description=(
            "zero: the heads write nothing (their slice of the attention output before the output projection is "
            "set to 0); mean: their slice is set to its mean over this text's positions"
        ),
    )
    top_k: int = Field(default=5, ge=1, le=50, description="positions with the largest effect listed")


class PositionEffect(BaseModel):
    position: int = Field(description="the position whose output changed (for a causal LM: predicting position+1)")
    token: str
    value: float = Field(description="KL(clean ‖ ablated) of the next-token distribution (nats), or 1 − cos")


class AblationReport(Report):
    heads: list[str] = Field(description='the ablated heads as "L.H"')
    method: AblationMethod
    measure: str = Field(description="next_token (causal LM: KL, loss, top token) or embedding (encoder: cosine)")
    tokens: int = Field(description="tokens in the text")
    kl_last_position: float | None = Field(default=None, description="KL(P_clean ‖ P_ablated) at the last position")
    kl_mean: float | None = Field(default=None, description="KL averaged over every position, nats")
    loss_clean: float | None = Field(default=None, description="mean next-token loss on the text, nats")
    loss_ablated: float | None = None
    loss_change: float | None = Field(default=None, description="loss_ablated − loss_clean (> 0: the heads helped)")
    top_token_clean: str | None = Field(default=None, description="most likely next token after the text")
    top_token_ablated: str | None = None
    top_token_changed: bool | None = None
    top_token_probability_clean: float | None = Field(default=None, description="its probability, clean model")
    top_token_probability_ablated: float | None = Field(
        default=None, description="the clean top token's probability with the heads ablated"
    )
    pooled_cosine_change: float | None = Field(
        default=None, description="encoder: 1 − cos between the mean-pooled embeddings, clean vs ablated"
    )
    mean_token_cosine_change: float | None = Field(default=None, description="encoder: mean over tokens of 1 − cos")
    largest_effects: list[PositionEffect] = Field(default_factory=list)


def parse_heads(heads: Sequence[str | HeadRef | dict], num_layers: int, num_heads: int) -> list[tuple[int, int]]:
    """Validate heads given as "L.H" strings or {layer, head}; ranges and duplicates are refused by name."""
    parsed: list[tuple[int, int]] = []
    for index, item in enumerate(heads):
        if isinstance(item, dict):
            item = HeadRef.model_validate(item)
        if isinstance(item, HeadRef):
            layer, head = item.layer, item.head
        else:
            match = _HEAD_STRING.match(str(item))
            if not match:
                msg = (
                    f'heads[{index}] {item!r} is not a head; write "L.H" with layer 0..{num_layers - 1} and head '
                    f'0..{num_heads - 1}, e.g. "{num_layers - 1}.0"'
                )
                raise InvalidInputError(msg, field="heads")
            layer = check_index(int(match.group(1)), num_layers, f"heads[{index}] layer")
            if match.group(2) == "*":
                parsed.extend((layer, head) for head in range(num_heads))
                continue
            head = int(match.group(2))
        check_index(layer, num_layers, f"heads[{index}] layer")
        check_index(head, num_heads, f"heads[{index}] head")
        parsed.append((layer, head))
    duplicates = sorted({h for h in parsed if parsed.count(h) > 1})
    if duplicates:
        shown = ", ".join(head_label(layer, head) for layer, head in duplicates)
        raise InvalidInputError(f"heads lists {shown} more than once; give each head once", field="heads")
    return parsed


def head_label(layer: int, head: int) -> str:
    return f"{layer}.{head}"


@dataclass(frozen=True)
class AblationEffect:
    """Clean vs ablated outputs of one input, as tensors for the service layer (never returned by a tool)."""

    clean: torch.Tensor  # (B, T, V) logits or (B, T, C) hidden states
    ablated: torch.Tensor
    language_model: bool


def model_output(output) -> tuple[torch.Tensor, bool]:
    logits = getattr(output, "logits", None)
    return (logits, True) if logits is not None else (output.last_hidden_state, False)


def run_ablation(
    loaded: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    heads: Sequence[tuple[int, int]],
    *,
    method: AblationMethod = "zero",
    clean: torch.Tensor | None = None,
) -> AblationEffect:
    """Clean (unless given) and ablated forwards with the model's own attention implementation, under its lock."""
    facts = loaded.facts
    grouped = group_heads(heads)
    model = loaded.model
    with loaded.lock, torch.inference_mode():
        means = None
        if clean is None or method == "mean":
            with recorded_head_means(
                model,
                list(grouped) if method == "mean" else [],
                num_heads=facts.num_heads,
                head_dim=facts.head_dim,
                attention_mask=attention_mask,
            ) as recorded:
                clean_out, is_lm = model_output(model(input_ids=input_ids, attention_mask=attention_mask))
            clean = clean if clean is not None else clean_out
            means = dict(recorded)
        with heads_ablated(
            model, grouped, num_heads=facts.num_heads, head_dim=facts.head_dim, method=method, means=means
        ):
            ablated, is_lm = model_output(model(input_ids=input_ids, attention_mask=attention_mask))
    return AblationEffect(clean=clean, ablated=ablated, language_model=is_lm)


def effect_size(effect: AblationEffect) -> float:
    """Causal LM: KL of the next-token distribution averaged over positions; encoder: pooled 1 − cos."""
    if effect.language_model:
        return float(next_token_kl(effect.clean, effect.ablated).mean())
    return float(cosine_change(effect.clean.mean(1), effect.ablated.mean(1)).mean())


def _decode(loaded: LoadedModel, token_id: int) -> str:
    return loaded.tokenizer.decode([token_id])  # type: ignore[attr-defined]


def ablate_heads(inspector: Inspector, args: AblateHeadsInput) -> AblationReport:
    """Remove the named heads' contribution and report how the model's output changes on the text."""
    loaded = inspector.model(args.model)
    facts = loaded.facts
    heads = parse_heads(args.heads, facts.num_layers, facts.num_heads)
    encoded = inspector.encode(loaded, args.text)
    effect = run_ablation(loaded, encoded.input_ids, encoded.attention_mask, heads, method=args.method)
    labels = [head_label(layer, head) for layer, head in heads]
    report = AblationReport(
        model=loaded.name,
        summary="",
        heads=labels,
        method=args.method,
        measure="next_token" if effect.language_model else "embedding",
        tokens=encoded.length,
    )
    if effect.language_model:
        return _next_token_report(report, loaded, encoded, effect, args.top_k)
    return _embedding_report(report, encoded, effect, args.top_k)


def _heads_shown(report: AblationReport) -> str:
    labels = report.heads
    return ", ".join(labels[:8]) + (f" and {len(labels) - 8} more" if len(labels) > 8 else "")


def _next_token_report(
    report: AblationReport, loaded: LoadedModel, encoded: Encoded, effect: AblationEffect, top_k: int
) -> AblationReport:
    tokens = encoded.tokens
    kl = next_token_kl(effect.clean[0], effect.ablated[0])  # (T,)
    kl_values: list[float] = kl.tolist()
    clean_probs = torch.softmax(effect.clean[0, -1].double(), -1)  # (V,)
    ablated_probs = torch.softmax(effect.ablated[0, -1].double(), -1)  # (V,)
    top_clean, top_ablated = int(clean_probs.argmax()), int(ablated_probs.argmax())
    p_clean, p_ablated = float(clean_probs[top_clean]), float(ablated_probs[top_clean])
    loss_clean = loss_ablated = None
    if encoded.length > 1:
        loss_clean = float(token_losses(effect.clean, encoded.input_ids).mean())
        loss_ablated = float(token_losses(effect.ablated, encoded.input_ids).mean())
    order: list[int] = kl.argsort(descending=True)[:top_k].tolist()
    largest = [PositionEffect(position=p, token=tokens[p].text, value=rounded(kl_values[p], 6)) for p in order]
    clean_text, ablated_text = _decode(loaded, top_clean), _decode(loaded, top_ablated)
    changed = top_clean != top_ablated
    findings = [
        Finding(
            kind="next_token_kl",
            position=p.position,
            token=p.token,
            value=p.value,
            detail=f"at position {p.position} {p.token!r} the next-token distribution moves by KL {p.value:.4g}",
        )
        for p in largest[:3]
    ]
    loss_text = ""
    if loss_clean is not None and loss_ablated is not None:
        change = loss_ablated - loss_clean
        loss_text = f" Loss on the text goes from {loss_clean:.4f} to {loss_ablated:.4f} nats ({change:+.4f})."
    top_text = (
        f"the top next token changes from {clean_text!r} to {ablated_text!r}"
        if changed
        else f"the top next token stays {clean_text!r} (p {p_clean:.3f} -> {p_ablated:.3f})"
    )
    mean = sum(kl_values) / len(kl_values)
    report.summary = (
        f"Ablating {_heads_shown(report)} ({report.method}) on {encoded.length} tokens: KL of the next-token "
        f"distribution {kl_values[-1]:.4g} nats at the last position, {mean:.4g} on average (largest "
        f"{kl_values[order[0]]:.4g} at position {order[0]} {tokens[order[0]].text!r}); {top_text}.{loss_text}"
    )
    report.findings = findings
    report.kl_last_position = rounded(kl_values[-1], 6)
    report.kl_mean = rounded(mean, 6)
    if loss_clean is not None and loss_ablated is not None:
        report.loss_clean, report.loss_ablated = rounded(loss_clean), rounded(loss_ablated)
        report.loss_change = rounded(loss_ablated - loss_clean, 6)
    report.top_token_clean, report.top_token_ablated, report.top_token_changed = clean_text, ablated_text, changed
    report.top_token_probability_clean = rounded(p_clean)
    report.top_token_probability_ablated = rounded(p_ablated)
    report.largest_effects = largest
    return report


def _embedding_report(report: AblationReport, encoded: Encoded, effect: AblationEffect, top_k: int) -> AblationReport:
    tokens = encoded.tokens
    per_token = cosine_change(effect.clean[0], effect.ablated[0])  # (T,)
    values: list[float] = per_token.tolist()
    pooled = float(cosine_change(effect.clean[0].mean(0), effect.ablated[0].mean(0)))
    order: list[int] = per_token.argsort(descending=True)[:top_k].tolist()
    largest = [PositionEffect(position=p, token=tokens[p].text, value=rounded(values[p], 6)) for p in order]
    mean = sum(values) / len(values)
    report.findings = [
        Finding(
            kind="embedding_change",
            position=p.position,
            token=p.token,
            value=p.value,
            detail=f"token {p.position} {p.token!r}'s output embedding turns by 1 − cos = {p.value:.4g}",
        )
        for p in largest[:3]
    ]
    report.summary = (
        f"Ablating {_heads_shown(report)} ({report.method}) on {encoded.length} tokens turns the mean-pooled "
        f"embedding by 1 − cos = {pooled:.4g}; per token {mean:.4g} on average, most at position {order[0]} "
        f"{tokens[order[0]].text!r} ({values[order[0]]:.4g})."
    )
    report.pooled_cosine_change = rounded(pooled, 6)
    report.mean_token_cosine_change = rounded(mean, 6)
    report.largest_effects = largest
    return report


SPEC = ToolSpec(
    name="ablate_heads",
    description=(
        "Check whether attention heads matter: remove their contribution (zero or mean-ablate their output before "
        "the output projection) and report, for a causal LM, the KL of the next-token distribution at the last "
        "position and on average, the change in loss on the text and whether the top next token changes; for an "
        "encoder, how far the pooled embedding turns. The model is restored exactly afterwards."
    ),
    input_model=AblateHeadsInput,
    output_model=AblationReport,
    run=ablate_heads,
    example={"text": "The cat sat on the mat because it was tired.", "heads": ["3.0", "3.1"]},
)
