"""plan_kv_cache's words: the summary and findings, written from the measured loss changes and the verified plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent_tools.schemas import Finding
from agent_tools.settings import readable_size


@dataclass(frozen=True)
class PlanNumbers:
    """What was measured (unrounded), under the names the report's plan and memory rows give it."""

    tokens: int
    sink: int
    window: int
    loss_budget: float
    planned_kv_heads: int
    total_kv_heads: int
    predicted_loss_change: float
    verified_loss_change: float
    verified_top_token_agreement: float
    context_length: int
    precision: str
    saved_bytes: int
    saved_fraction: float
    needs_full: Sequence[tuple[str, float]]  # (KV head label, loss change), the largest first
    additive_kv_heads: int = 0  # heads the additive plan chose before verification
    additive_verified_loss_change: float = 0.0  # its verified loss change
    additive_loss_change: float = 0.0  # Σ of the planned heads' own changes
    tolerance: float = 0.0  # |verified − predicted| every accepted step kept within
    runs: int = 0  # verifying runs


def summary(n: PlanNumbers) -> str:
    """How many KV heads fit the short cache, prediction vs verification, the memory, and the caveat."""
    worst = ", ".join(f"{label} {change:+.4f}" for label, change in n.needs_full[:3])
    return (
        f"On this text ({n.tokens} tokens) {n.planned_kv_heads} of {n.total_kv_heads} KV heads could keep only the "
        f"first {n.sink} and last {n.window} tokens within a loss budget of {n.loss_budget:g} nats: predicted loss "
        f"change {n.predicted_loss_change:+.4f}, verified {n.verified_loss_change:+.4f} with all of them restricted "
        f"at once (within the {n.tolerance:g}-nat tolerance; top next token unchanged at "
        f"{n.verified_top_token_agreement:.1%} of positions){_cut(n)}. At {n.context_length:,} tokens in "
        f"{n.precision} that saves {readable_size(n.saved_bytes)} ({n.saved_fraction:.1%} of the KV cache). Heads "
        f"needing the full cache most: {worst}. Measured on this text only: check on texts like the ones you serve."
    )


def _cut(n: PlanNumbers) -> str:
    if n.additive_kv_heads <= n.planned_kv_heads or n.additive_verified_loss_change <= n.loss_budget:
        return ""
    return (
        f"; single-head effects did not add up: the additive plan of {n.additive_kv_heads} heads verified at "
        f"{n.additive_verified_loss_change:+.4f}, over the budget, so the plan was built in verified groups "
        f"({n.runs} runs)"
    )


def findings(n: PlanNumbers) -> list[Finding]:
    found = [
        Finding(
            kind="needs_full_cache",
            severity="high" if index == 0 else "medium",
            value=change,
            detail=f"KV head {label} raises the loss by {change:+.4f} nats when it reads only sink + window tokens",
        )
        for index, (label, change) in enumerate(n.needs_full[:3])
        if change > 0
    ]
    gap = n.verified_loss_change - n.predicted_loss_change
    found.append(
        Finding(
            kind="plan_verified",
            severity="high",
            value=n.verified_loss_change,
            detail=f"the plan ({n.planned_kv_heads} KV heads) was run at once: loss change "
            f"{n.verified_loss_change:+.4f} vs {n.predicted_loss_change:+.4f} predicted from the previous verified "
            f"step plus the added heads' own changes (gap {gap:+.4f}, tolerance {n.tolerance:g}); adding every "
            "planned head's own change gives "
            f"{n.additive_loss_change:+.4f}; top token agrees at {n.verified_top_token_agreement:.1%}",
        )
    )
    found.append(
        Finding(
            kind="memory_saved",
            severity="medium",
            value=float(n.saved_bytes),
            detail=f"at {n.context_length:,} tokens ({n.precision}) the plan saves {readable_size(n.saved_bytes)}, "
            f"{n.saved_fraction:.1%} of the KV cache",
        )
    )
    return found
