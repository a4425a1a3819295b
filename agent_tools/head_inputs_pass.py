"""The forward pass that keeps one head's inputs, as a plan: shared by reconstruct_attention and inspect_projections.

The consumer, the inputs it yields and the parity check live in :mod:`agent_tools.consumers.head_inputs`; this
module only wraps them in a :class:`~agent_tools.inspector.PassPlan` (the service layer: consumers may not
import the inspector), checking the memory budget first.
"""

from __future__ import annotations

from agent_tools.consumers.head_inputs import HeadInputs, HeadInputsConsumer
from agent_tools.inspector import Encoded, Inspector, PassPlan
from agent_tools.loading import LoadedModel


def plan_head_inputs(
    inspector: Inspector, loaded: LoadedModel, encoded: Encoded, layer: int, heads: list[int]
) -> PassPlan[HeadInputs]:
    """The pass over ``layer`` with its input recorded; ``finish`` returns ``heads[0]``'s checked inputs."""
    consumer = HeadInputsConsumer.for_heads(loaded.model, loaded.facts, layer, heads, stack=encoded.stack)
    inspector.check_budget(consumer.held_bytes(encoded.length), "this reconstruction")

    def finish(_output: object) -> HeadInputs:
        return consumer.inputs()

    return PassPlan(loaded, encoded, [consumer], finish, layers=[layer], record_inputs=True)
