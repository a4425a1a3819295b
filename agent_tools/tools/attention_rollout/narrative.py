"""attention_rollout's findings and summary: text written from the measured :class:`RolloutNumbers`."""

from __future__ import annotations

from dataclasses import dataclass

from agent_tools.schemas import Finding, NextCall, Token, follow_up, rounded, text_follow_up
from agent_tools.tools.attention_rollout.models import AttentionRolloutInput, RolloutReport, SourceShare

SINK_DOMINANCE = 0.9  # rollout share of token 0 above which the summary warns that a sink dominates


@dataclass(frozen=True)
class RolloutNumbers:
    """One rollout, measured: everything the narrative is written from."""

    position: int  # the target position
    last_layer: int  # rollout runs through layers 0..last_layer
    residual: float
    tokens: list[Token]
    shares: list[float]  # (T,) rollout share of each source token
    raw_max: float  # the target's largest last-layer attention weight
    raw_argmax: int  # ... and the token it goes to
    top: list[SourceShare]  # the top_k sources, largest share first


def narrate(numbers: RolloutNumbers) -> tuple[str, list[Finding]]:
    """The summary and the findings of one rollout; a sink-dominance caveat leads both when token 0 soaks it up."""
    findings = [_source(numbers, s) for s in numbers.top]
    summary = _summary(numbers)
    if numbers.position > 0 and numbers.shares[0] >= SINK_DOMINANCE:
        summary += _sink_caveat(numbers)
        findings.insert(0, _sink_finding(numbers))
    return summary, findings


def _source(numbers: RolloutNumbers, source: SourceShare) -> Finding:
    target = numbers.tokens[numbers.position].text
    return Finding(
        kind="rollout_source",
        layer=numbers.last_layer,
        position=source.position,
        token=source.token,
        value=source.share,
        detail=f"{source.share:.1%} of position {numbers.position} {target!r} flows from token {source.position} "
        f"{source.token!r} (last-layer attention {source.last_layer_attention:.1%})",
    )


def _summary(numbers: RolloutNumbers) -> str:
    tokens, position, length = numbers.tokens, numbers.position, len(numbers.shares)
    listed = ", ".join(f"{s.position} {s.token!r} {s.share:.1%}" for s in numbers.top[:3])
    return (
        f"Attention rollout through layers 0..{numbers.last_layer} (residual {numbers.residual}) for position "
        f"{position} {tokens[position].text!r} of {length} tokens: most flows from {listed}; its own token "
        f"keeps {numbers.shares[position]:.1%}. Last-layer attention alone puts {numbers.raw_max:.1%} on token "
        f"{numbers.raw_argmax} {tokens[numbers.raw_argmax].text!r}."
    )


def _sink_caveat(numbers: RolloutNumbers) -> str:
    return (
        f" Caveat: {numbers.shares[0]:.0%} of the rollout lands on token 0 {numbers.tokens[0].text!r} — multiplying "
        "many layers whose heads park on an attention sink collapses rollout onto it; compare the raw last-layer "
        "attention or roll out through fewer layers (up_to_layer)."
    )


def _sink_finding(numbers: RolloutNumbers) -> Finding:
    first_share = numbers.shares[0]
    return Finding(
        kind="rollout_sink_dominance",
        severity="high",
        layer=numbers.last_layer,
        position=0,
        token=numbers.tokens[0].text,
        value=rounded(first_share),
        detail=f"rollout puts {first_share:.1%} on the first token: attention-sink dominance, not evidence of "
        "meaning flow",
    )


def next_calls(args: AttentionRolloutInput, report: RolloutReport) -> list[NextCall]:
    """Fewer layers when a sink soaks the rollout up, the heads that park on it, and what the answer depends on."""
    calls = []
    if any(f.kind == "rollout_sink_dominance" for f in report.findings) and report.layers > 2:
        calls.append(
            text_follow_up(
                args,
                "attention_rollout",
                {"position": report.position, "up_to_layer": report.layers // 2 - 1},
                f"rollout through the first {report.layers // 2} layers only, before the sink soaks it up",
            )
        )
    calls.append(
        text_follow_up(
            args, "diagnose_collapse", {}, "which heads park on the first token, and whether they write anything"
        )
    )
    calls.append(
        follow_up(
            "trace_prompt_attention",
            {"prompt": args.text},
            "what the next token depends on (causal checks), not only what flows to it",
            model=args.model,
        )
    )
    return calls
