"""show_attention's pass and numbers: one forward keeping one head's map, then per-query top keys and entropies.

The pass streams into a :class:`~agent_tools.consumers.head_map.HeadMapConsumer` through the inspector and stops
after the head's layer; the words come from :mod:`.narrative`.
"""

from __future__ import annotations

import torch

from agent_tools.analysis.metrics import attention_entropy, normalised_entropy, received_attention, threshold_sinks
from agent_tools.consumers.head_map import HeadMapConsumer
from agent_tools.inspector import Inspector, text_digest
from agent_tools.render import attention_heatmap
from agent_tools.schemas import KeyWeight, Token
from agent_tools.stack_input import on_stack
from agent_tools.tools.show_attention.models import AttentionView, QueryRow, ShowAttentionInput
from agent_tools.tools.show_attention.narrative import (
    QUERY_LINES,
    SINK_SHARE,
    HeadView,
    most_read_finding,
    query_findings,
    sink_finding,
    summary,
)

# Bytes held per query×key entry: the float32 map (chunks + their concatenation) and the bool visibility mask;
# with include_map the map as Python floats in the report and its JSON; with png a Python copy for matplotlib.
HELD_BYTES_PER_ENTRY = 2 * 4 + 1
INCLUDED_MAP_BYTES_PER_ENTRY = 48
PNG_BYTES_PER_ENTRY = 32


def held_bytes(length: int, *, include_map: bool, png: bool) -> int:
    """Estimate of what one head's map costs to hold: T² entries at the bytes each form takes."""
    per_entry = HELD_BYTES_PER_ENTRY + include_map * INCLUDED_MAP_BYTES_PER_ENTRY + png * PNG_BYTES_PER_ENTRY
    return length * length * per_entry


def show_attention(inspector: Inspector, args: ShowAttentionInput) -> AttentionView:
    """For one layer and head: each query's top keys with weights, entropies, and optionally the map."""
    loaded = inspector.model(args.model)
    stack = inspector.attention_stack(loaded, args.attention)
    layer = inspector.check_layer(loaded, args.layer, stack)
    head = inspector.check_head(loaded, args.head, stack)
    encoded = inspector.encode_on(loaded, args.text, stack)
    queries, keys = encoded.query_tokens, encoded.key_tokens
    side = max(len(queries), len(keys))
    inspector.check_budget(held_bytes(side, include_map=args.include_map, png=args.png), "this map")
    consumer = HeadMapConsumer(layer, head)  # one forward pass keeping only this head's map
    inspector.run(loaded, encoded, [consumer], layers=[layer], need_output=False)
    weights, allowed = consumer.result()  # (rows, keys) each
    entropy = attention_entropy(weights)  # (rows,)
    column_share = weights.mean(0)  # (keys,) mean weight each key receives
    top_key = int(column_share.argmax())
    view = HeadView(
        layer=layer,
        head=head,
        length=len(queries),
        mean_entropy=float(entropy.mean()),
        mean_normalised_entropy=float(normalised_entropy(weights, allowed).mean()),
        top_key=top_key,
        top_token=keys[top_key].text,
        top_share=float(column_share[top_key]),
        sinks=_sinks(weights, allowed, keys, same_tokens=queries is keys or len(queries) == len(keys)),
    )
    rows = _rows(weights, allowed, entropy, queries, keys, args.top_k)
    findings = [f for f in (sink_finding(view), most_read_finding(view)) if f is not None]
    if len(rows) <= QUERY_LINES:
        findings += query_findings(rows)
    png_path = None
    if args.png:
        where = "" if stack.name == "self" else f"{stack.name}-"
        stem = f"attention-{loaded.name}-{where}L{layer}H{head}-{text_digest(args.text)}"
        path = inspector.artifact_path(stem, ".png")
        title = f"{loaded.name} — {where}layer {layer}, head {head}"
        attention_heatmap(weights.tolist(), encoded.query_labels(), encoded.key_labels(), title, path)
        png_path = str(path)
    return AttentionView(
        model=loaded.name,
        summary=on_stack(stack.name, summary(view)),
        findings=findings,
        attention=stack.name,
        layer=layer,
        head=head,
        kv_head=stack.kv_head_of(head),
        tokens=keys,
        rows=rows,
        mean_entropy=view.mean_entropy,
        mean_normalised_entropy=view.mean_normalised_entropy,
        weights=weights.tolist() if args.include_map else None,
        png_path=png_path,
    )


def _sinks(
    weights: torch.Tensor, allowed: torch.Tensor, keys: list[Token], *, same_tokens: bool
) -> tuple[tuple[int, str, float], ...]:
    """Special tokens (and the first token) read at a sink's share by the other queries (largest share first)."""
    rows = weights.shape[0]
    own = (
        torch.arange(rows, device=weights.device) if same_tokens else torch.full((rows,), -1, device=weights.device)
    )  # (rows,) each query's own key column
    received = received_attention(weights[None].float(), allowed, own)  # one head: (1, rows, keys)
    found = threshold_sinks(received, threshold=SINK_SHARE, min_readers=min(4, max(1, rows - 1)), always=())
    share = received.mean_share()  # (keys,) mean share over the queries that read it
    sinks = [(p, keys[p].text, float(share[p])) for p in found if keys[p].special or p == 0]
    return tuple(sorted(sinks, key=lambda s: -s[2]))


def _rows(
    weights: torch.Tensor,
    allowed: torch.Tensor,
    entropy: torch.Tensor,
    tokens: list[Token],
    key_tokens: list[Token],
    top_k: int,
) -> list[QueryRow]:
    """Per query: its entropy and its top keys among those it may read (``key_tokens`` label the columns)."""
    values, indices = weights.topk(min(top_k, weights.shape[-1]), dim=-1)  # (rows, k) largest first
    readable = allowed.gather(-1, indices)  # (rows, k) whether each top key may be read
    # one copy each, not a conversion per row and key
    value_rows, index_rows, readable_rows = values.tolist(), indices.tolist(), readable.tolist()
    entropies = entropy.tolist()
    rows = []
    for q in range(len(tokens)):
        keys = [
            KeyWeight(position=i, token=key_tokens[i].text, weight=v)
            for v, i, ok in zip(value_rows[q], index_rows[q], readable_rows[q], strict=True)
            if ok
        ]
        rows.append(QueryRow(position=q, token=tokens[q].text, entropy=entropies[q], top_keys=keys))
    return rows
