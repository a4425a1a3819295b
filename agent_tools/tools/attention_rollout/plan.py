"""attention_rollout's pass: stream rollout and the target's last-layer row through layers 0..up_to_layer.

The pass is a :class:`~agent_tools.inspector.PassPlan` (run by the inspector, no language-model head); its
``finish`` turns the rollout row into per-token shares and hands them to the narrative.
"""

from __future__ import annotations

import torch

from agent_tools.consumers.rollout import RolloutConsumer
from agent_tools.consumers.target_row import TargetRowConsumer
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Encoded, Inspector, PassPlan
from agent_tools.loading import LoadedModel
from agent_tools.schemas import rounded
from agent_tools.tools.attention_rollout.models import AttentionRolloutInput, RolloutReport, SourceShare
from agent_tools.tools.attention_rollout.narrative import RolloutNumbers, narrate


def attention_rollout(inspector: Inspector, args: AttentionRolloutInput) -> RolloutReport:
    """Rollout (Abnar & Zuidema 2020) for one target position: every source token's share, summing to 1."""
    return inspector.execute(plan_attention_rollout(inspector, args))


def plan_attention_rollout(inspector: Inspector, args: AttentionRolloutInput) -> PassPlan[RolloutReport]:
    """Check the arguments and the memory budget, and declare the pass: rollout plus the target's raw row."""
    loaded = inspector.model(args.model)
    facts = loaded.facts
    last_layer = facts.num_layers - 1 if args.up_to_layer is None else inspector.check_layer(loaded, args.up_to_layer)
    encoded = inspector.encode(loaded, args.text)
    position = _target_position(args.position, encoded.length, causal=facts.is_causal)
    inspector.check_budget(3 * encoded.length * encoded.length * 4, "rollout")
    rollout = RolloutConsumer(residual=args.residual)
    target = TargetRowConsumer(last_layer, position)

    def finish(_output: object) -> RolloutReport:
        raw = target.row if target.row is not None else torch.zeros(encoded.length)  # (T,) on the CPU
        row = rollout.rollout()[position].cpu().double()  # (T,): the one row of the rollout the report reads
        return _report(loaded, encoded, args, position=position, last_layer=last_layer, row=row, raw=raw)

    return PassPlan(loaded, encoded, [rollout, target], finish, layers=list(range(last_layer + 1)), need_output=False)


def _target_position(position: int | None, length: int, *, causal: bool) -> int:
    """The 0-based target: the last token (causal) or the first (encoders) by default; negatives count from the end."""
    chosen = (length - 1 if causal else 0) if position is None else position
    if not -length <= chosen < length:
        msg = f"position {chosen} out of range 0..{length - 1} (or -{length}..-1 from the end) for this text"
        raise InvalidInputError(msg, field="position")
    return chosen % length


def _report(
    loaded: LoadedModel,
    encoded: Encoded,
    args: AttentionRolloutInput,
    *,
    position: int,
    last_layer: int,
    row: torch.Tensor,
    raw: torch.Tensor,
) -> RolloutReport:
    """(T,) rollout row and (T,) raw last-layer row of the target -> the report."""
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
        for j in range(encoded.length)
    ]
    top = [sources[j] for j in row.argsort(descending=True)[: args.top_k].tolist()]
    numbers = RolloutNumbers(
        position=position,
        last_layer=last_layer,
        residual=args.residual,
        tokens=tokens,
        shares=shares,
        raw_max=float(raw.max()),
        raw_argmax=int(raw.argmax()),
        top=top,
    )
    summary, findings = narrate(numbers)
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
