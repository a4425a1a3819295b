"""show_attention: what does layer L / head H attend to on this text?"""

from __future__ import annotations

import torch
from pydantic import BaseModel, Field

from agent_tools.analysis.maps import attention_entropy, normalised_entropy, top_keys
from agent_tools.capture import LayerAttention
from agent_tools.inspector import Inspector, text_digest
from agent_tools.render import attention_heatmap
from agent_tools.schemas import Finding, KeyWeight, Report, TextInput, Token, rounded
from agent_tools.tools.registry import ToolSpec

# Bytes held per query×key entry: the float32 map (chunks + their concatenation) and the bool visibility mask;
# with include_map the map as Python floats in the report and its JSON; with png a Python copy for matplotlib.
HELD_BYTES_PER_ENTRY = 2 * 4 + 1
INCLUDED_MAP_BYTES_PER_ENTRY = 48
PNG_BYTES_PER_ENTRY = 32


class ShowAttentionInput(TextInput):
    layer: int = Field(description="layer index, 0-based (describe_model gives the range)")
    head: int = Field(description="query head index, 0-based")
    top_k: int = Field(default=3, ge=1, le=20, description="keys listed per query")
    include_map: bool = Field(default=False, description="return the full query × key weight matrix (T² numbers)")
    png: bool = Field(default=False, description="write the map as a PNG heatmap into the session's artifact folder")


class QueryRow(BaseModel):
    position: int
    token: str
    entropy: float = Field(description="entropy of this query's weights, nats")
    top_keys: list[KeyWeight]


class AttentionView(Report):
    layer: int
    head: int
    kv_head: int = Field(description="the KV head this query head reads (grouped-query attention)")
    tokens: list[Token]
    rows: list[QueryRow]
    mean_entropy: float = Field(description="mean entropy over queries, nats")
    mean_normalised_entropy: float = Field(description="mean of entropy / log(keys visible), 0 = one key, 1 = uniform")
    weights: list[list[float]] | None = Field(default=None, description="the full map (queries × keys), when asked")
    png_path: str | None = None


class HeadMapConsumer:
    """Keeps one head's rows of one layer (chunk by chunk) and nothing else."""

    def __init__(self, layer: int, head: int) -> None:
        self.layer, self.head = layer, head
        self.rows: list[torch.Tensor] = []
        self.allowed: list[torch.Tensor] = []

    def on_layer(self, captured: LayerAttention) -> None:
        if captured.layer != self.layer:
            return
        self.rows.append(captured.weights[0, self.head].clone())  # (q, Tk)
        self.allowed.append(captured.allowed()[0, 0].clone())  # (q, Tk)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.rows), torch.cat(self.allowed)  # (T, T) each


def capture_head_map(inspector: Inspector, loaded, encoded, layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass that keeps only layer/head's map: (T, T) weights and (T, T) allowed."""
    consumer = HeadMapConsumer(layer, head)
    inspector.run(loaded, encoded, [consumer], layers=[layer], need_output=False)
    return consumer.result()


def held_bytes(length: int, *, include_map: bool, png: bool) -> int:
    """Estimate of what one head's map costs to hold: T² entries at the bytes each form takes."""
    per_entry = HELD_BYTES_PER_ENTRY + include_map * INCLUDED_MAP_BYTES_PER_ENTRY + png * PNG_BYTES_PER_ENTRY
    return length * length * per_entry


def show_attention(inspector: Inspector, args: ShowAttentionInput) -> AttentionView:
    """For one layer and head: each query's top keys with weights, entropies, and optionally the map."""
    loaded = inspector.model(args.model)
    layer = inspector.check_layer(loaded, args.layer)
    head = inspector.check_head(loaded, args.head)
    encoded = inspector.encode(loaded, args.text)
    inspector.check_budget(held_bytes(encoded.length, include_map=args.include_map, png=args.png), "this map")
    weights, allowed = capture_head_map(inspector, loaded, encoded, layer, head)
    entropy = attention_entropy(weights)  # (T,)
    normalised = normalised_entropy(weights, allowed)  # (T,)
    values, indices = top_keys(weights, args.top_k)  # (T, k)
    tokens = encoded.tokens
    rows = []
    for q in range(encoded.length):
        keys = [
            KeyWeight(position=int(i), token=tokens[int(i)].text, weight=rounded(v))
            for v, i in zip(values[q].tolist(), indices[q].tolist(), strict=True)
            if allowed[q, int(i)]
        ]
        rows.append(QueryRow(position=q, token=tokens[q].text, entropy=rounded(entropy[q]), top_keys=keys))
    column_share = weights.mean(0)  # (T,) mean weight each key receives
    top_key = int(column_share.argmax())
    mean_norm = float(normalised.mean())
    findings = [
        Finding(
            kind="most_read_key",
            layer=layer,
            head=head,
            position=top_key,
            token=tokens[top_key].text,
            value=rounded(column_share[top_key]),
            detail=f"L{layer}H{head} gives token {top_key} {tokens[top_key].text!r} "
            f"{column_share[top_key]:.1%} of its attention on average",
        )
    ]
    png_path = None
    if args.png:
        path = inspector.artifact_path(f"attention-{loaded.name}-L{layer}H{head}-{text_digest(args.text)}", ".png")
        labels = encoded.labels()
        attention_heatmap(weights.tolist(), labels, labels, f"{loaded.name} — layer {layer}, head {head}", path)
        png_path = str(path)
    summary = (
        f"Layer {layer} head {head} on {encoded.length} tokens: mean entropy {float(entropy.mean()):.3f} nats "
        f"({mean_norm:.0%} of uniform); it reads token {top_key} {tokens[top_key].text!r} most "
        f"({float(column_share[top_key]):.1%} of attention on average)."
    )
    return AttentionView(
        model=loaded.name,
        summary=summary,
        findings=findings,
        layer=layer,
        head=head,
        kv_head=loaded.facts.kv_head_of(head),
        tokens=tokens,
        rows=rows,
        mean_entropy=rounded(entropy.mean()),
        mean_normalised_entropy=rounded(mean_norm),
        weights=[[rounded(v, 6) for v in row] for row in weights.tolist()] if args.include_map else None,
        png_path=png_path,
    )


SPEC = ToolSpec(
    name="show_attention",
    description=(
        "Show what one attention head reads on a text: for every query token its top keys with weights, the "
        "entropy of each row and of the head, the most-read token, and optionally the full map or a PNG heatmap."
    ),
    input_model=ShowAttentionInput,
    output_model=AttentionView,
    run=show_attention,
    example={"text": "The cat sat on the mat because it was tired.", "layer": 3, "head": 0},
)
