"""find_circuit's words: one sentence per edge, the summary and findings."""

from __future__ import annotations

from agent_tools.schemas import Finding
from agent_tools.tools.find_circuit.models import CircuitEdge, CurvePoint

PATHS = {"Q": "its queries (Q-composition)", "K": "its keys (K-composition)", "V": "its values (V-composition)"}


def sentence(sender: str, receiver: str, kind: str, score: float) -> str:
    """'L1H0 reads L0H0's output through its keys (K-composition), score 0.54.'"""
    source = "the embeddings" if sender == "embeddings" else f"{sender}'s output"
    toward = "toward the clean answer" if score >= 0 else "against the clean answer"
    if kind == "direct":
        return f"The logits read {source} directly, score {score:.2f} of the gap ({toward})."
    return f"{receiver} reads {source} through {PATHS[kind]}, score {score:.2f} of the gap ({toward})."


def summary(
    edges: list[CircuitEdge], curve: CurvePoint, reached: bool, target: float, answer: str, empty: float
) -> str:
    head = f"{curve.edges} edge(s) explain {curve.faithfulness:.0%} of the logit difference for {answer!r}"
    versus = (
        f" (random edge sets of that size: {curve.random_mean:.0%} ± {curve.random_spread:.0%}; no edge: {empty:.0%})"
    )
    verdict = "" if reached else f"; the target {target:.0%} was not reached by any ranked set tried"
    top = f" Strongest: {edges[0].sentence}" if edges else ""
    return head + versus + verdict + "." + top


def findings(edges: list[CircuitEdge]) -> list[Finding]:
    return [
        Finding(kind=f"edge_{e.kind}", severity="high" if i < 3 else "medium", value=e.score, detail=e.sentence)
        for i, e in enumerate(edges[:8])
    ]
