"""attention_rollout: how much does each input token flow into one position through all the layers?"""

from __future__ import annotations

import torch
from pydantic import BaseModel, Field

from agent_tools.analysis.rollout import RolloutConsumer
from agent_tools.capture import LayerAttention
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.schemas import Finding, Report, TextInput, rounded
from agent_tools.tools.registry import ToolSpec

SINK_DOMINANCE = 0.9  # rollout share of token 0 above which the summary warns that a sink dominates


class AttentionRolloutInput(TextInput):
    position: int | None = Field(
        default=None,
        description="target token position (0-based; negative counts from the end, -1 = last); omitted = the last "
        "token for causal models, the first ([CLS]) for encoders",
    )
    up_to_layer: int | None = Field(
        default=None, description="roll out through layers 0..up_to_layer only; omitted = every layer"
    )
    residual: float = Field(
        default=0.5,
        ge=0.0,
        lt=1.0,
        description="weight r of the identity (residual stream) in each layer's Â = r·I + (1 − r)·Ā; 0.5 in the paper",
    )
    top_k: int = Field(default=5, ge=1, le=50, description="source tokens named in the summary and findings")


class SourceShare(BaseModel):
    position: int
    token: str
    share: float = Field(description="rollout: share of the target's representation that flows from this token")
    last_layer_attention: float = Field(description="the target's head-averaged attention to it in the last layer used")


class RolloutReport(Report):
    position: int
    token: str
    layers: int = Field(description="layers rolled out (0..layers-1)")
    residual: float
    sources: list[SourceShare] = Field(description="every source token, in position order; shares sum to 1")
    top_sources: list[SourceShare]
    total: float = Field(description="sum of the shares (1 up to rounding)")


class TargetRowConsumer:
    """Keeps the target row of one layer's head-averaged attention (chunk-aware); nothing else."""

    def __init__(self, layer: int, position: int) -> None:
        self.layer, self.position = layer, position
        self.row: torch.Tensor | None = None

    def on_layer(self, captured: LayerAttention) -> None:
        if captured.layer != self.layer:
            return
        local = self.position - captured.key_index_offset
        if 0 <= local < captured.weights.shape[2]:
            self.row = captured.weights[0, :, local].float().mean(0).clone()  # (Tk,)


def attention_rollout(inspector: Inspector, args: AttentionRolloutInput) -> RolloutReport:
    """Rollout (Abnar & Zuidema 2020) for one target position: every source token's share, summing to 1."""
    loaded = inspector.model(args.model)
    facts = loaded.facts
    last_layer = facts.num_layers - 1 if args.up_to_layer is None else inspector.check_layer(loaded, args.up_to_layer)
    encoded = inspector.encode(loaded, args.text)
    length = encoded.length
    default = length - 1 if facts.is_causal else 0
    position = default if args.position is None else args.position
    if not -length <= position < length:
        msg = f"position {position} out of range 0..{length - 1} (or -{length}..-1 from the end) for this text"
        raise InvalidInputError(msg, field="position")
    position %= length
    inspector.check_budget(3 * length * length * 4, "rollout")
    rollout = RolloutConsumer(residual=args.residual)
    target = TargetRowConsumer(last_layer, position)
    inspector.run(loaded, encoded, [rollout, target], layers=list(range(last_layer + 1)), need_output=False)
    row = rollout.rollout()[position].double()  # (T,)
    raw = target.row if target.row is not None else torch.zeros(length)
    tokens = encoded.tokens
    shares: list[float] = row.tolist()
    raw_values: list[float] = raw.tolist()
    sources = [
        SourceShare(
            position=j,
            token=tokens[j].text,
            share=rounded(shares[j], 6),
            last_layer_attention=rounded(raw_values[j], 6),
        )
        for j in range(length)
    ]
    order = row.argsort(descending=True)[: args.top_k].tolist()
    top = [sources[j] for j in order]
    findings = [
        Finding(
            kind="rollout_source",
            layer=last_layer,
            position=s.position,
            token=s.token,
            value=s.share,
            detail=f"{s.share:.1%} of position {position} {tokens[position].text!r} flows from token {s.position} "
            f"{s.token!r} (last-layer attention {s.last_layer_attention:.1%})",
        )
        for s in top
    ]
    listed = ", ".join(f"{s.position} {s.token!r} {s.share:.1%}" for s in top[:3])
    summary = (
        f"Attention rollout through layers 0..{last_layer} (residual {args.residual}) for position {position} "
        f"{tokens[position].text!r} of {length} tokens: most flows from {listed}; its own token keeps "
        f"{float(row[position]):.1%}. Last-layer attention alone puts {float(raw.max()):.1%} on token "
        f"{int(raw.argmax())} {tokens[int(raw.argmax())].text!r}."
    )
    first_share = shares[0]
    if position > 0 and first_share >= SINK_DOMINANCE:
        summary += (
            f" Caveat: {first_share:.0%} of the rollout lands on token 0 {tokens[0].text!r} — multiplying many layers "
            "whose heads park on an attention sink collapses rollout onto it; compare the raw last-layer attention "
            "or roll out through fewer layers (up_to_layer)."
        )
        findings.insert(
            0,
            Finding(
                kind="rollout_sink_dominance",
                layer=last_layer,
                position=0,
                token=tokens[0].text,
                value=rounded(first_share),
                detail=f"rollout puts {first_share:.1%} on the first token: attention-sink dominance, not evidence of "
                "meaning flow",
            ),
        )
    return RolloutReport(
        model=loaded.name,
        summary=summary,
        findings=findings,
        position=position,
        token=tokens[position].text,
        layers=last_layer + 1,
        residual=args.residual,
        sources=sources,
        top_sources=top,
        total=rounded(sum(shares), 6),
    )


SPEC = ToolSpec(
    name="attention_rollout",
    description=(
        "Attention rollout (Abnar & Zuidema 2020) for one target token: the head-averaged attention of every layer, "
        "mixed with the identity for the residual stream and multiplied through the layers, gives each source "
        "token's share of the target (shares sum to 1), next to the target's raw last-layer attention."
    ),
    input_model=AttentionRolloutInput,
    output_model=RolloutReport,
    run=attention_rollout,
    example={"text": "The cat sat on the mat because it was tired."},
)
