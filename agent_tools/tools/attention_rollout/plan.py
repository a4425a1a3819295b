"""attention_rollout's pass: stream rollout and the target's last-layer row through layers 0..up_to_layer.

The pass is a :class:`~agent_tools.inspector.PassPlan` (run by the inspector, no language-model head); its
``finish`` turns the rollout row into per-token shares and hands them to the narrative.
"""

from __future__ import annotations

import torch

from agent_tools.consumers.rollout import RolloutConsumer
from agent_tools.consumers.target_row import TargetRowConsumer
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector, PassPlan
from agent_tools.stack_input import on_stack
from agent_tools.tools.attention_rollout.models import AttentionRolloutInput, RolloutReport, SourceShare
from agent_tools.tools.attention_rollout.narrative import RolloutNumbers, narrate


def plan_attention_rollout(inspector: Inspector, args: AttentionRolloutInput) -> PassPlan[RolloutReport]:
    """Rollout (Abnar & Zuidema 2020) for one target position: every source token's share, summing to 1.

    Check the arguments and the memory budget, and declare the pass: rollout plus the target's raw row."""
    loaded = inspector.model(args.model)
    stack = inspector.attention_stack(loaded, args.attention)
    inspector.require_stack(loaded, stack, ("self", "encoder", "decoder"), CROSS_REFUSAL)
    if args.up_to_layer is None:
        last_layer = stack.num_layers - 1
    else:
        last_layer = inspector.check_layer(loaded, args.up_to_layer, stack)
    encoded = inspector.encode_on(loaded, args.text, stack)
    length = len(encoded.query_tokens)  # the decoder's answer tokens on the decoder stack, else the text's
    position = _target_position(args.position, length, causal=stack.is_causal)
    inspector.check_budget(3 * length * length * 4, "rollout")
    rollout = RolloutConsumer(residual=args.residual)
    target = TargetRowConsumer(last_layer, position)

    def finish(_output: object) -> RolloutReport:
        """The target's (T,) rollout row and (T,) raw last-layer row -> the report (on the attention stack)."""
        raw = target.row if target.row is not None else torch.zeros(length)  # (T,) on the CPU
        row = rollout.rollout()[position].cpu().double()  # (T,): the one row of the rollout the report reads
        tokens = encoded.query_tokens  # = the key tokens: rollout runs on a self-attention stack
        shares: list[float] = row.tolist()
        raw_values: list[float] = raw.tolist()
        sources = [
            SourceShare(position=j, token=tokens[j].text, share=shares[j], last_layer_attention=raw_values[j])
            for j in range(len(tokens))
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
            summary=on_stack(stack.name, summary),
            findings=findings,
            attention=stack.name,
            position=position,
            token=tokens[position].text,
            layers=last_layer + 1,
            residual=args.residual,
            sources=sources,
            top_sources=top,
            total=sum(shares),
        )

    return PassPlan(loaded, encoded, [rollout, target], finish, layers=list(range(last_layer + 1)), need_output=False)


CROSS_REFUSAL = (
    "rollout multiplies the (T, T) self-attention maps of one sequence layer after layer; cross-attention maps "
    "the answer's tokens onto the input's and every decoder layer reads the same encoder output, so its maps do "
    "not compose that way (the encoder's rollout is attention='encoder'; which input the answer read is "
    "trace_prompt_attention)"
)


def _target_position(position: int | None, length: int, *, causal: bool) -> int:
    """The 0-based target: the last token (causal) or the first (encoders) by default; negatives count from the end."""
    chosen = (length - 1 if causal else 0) if position is None else position
    if not -length <= chosen < length:
        msg = f"position {chosen} out of range 0..{length - 1} (or -{length}..-1 from the end) for this text"
        raise InvalidInputError(msg, field="position")
    return chosen % length
