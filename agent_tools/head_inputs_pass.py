"""The forward pass that keeps one head's inputs, as a plan: shared by reconstruct_attention and inspect_projections.

The consumer, the inputs it yields and the parity check live in :mod:`agent_tools.consumers.head_inputs`; this
module only wraps them in a :class:`~agent_tools.inspector.PassPlan` (the service layer: consumers may not
import the inspector), checking the memory budget first. :func:`head_on_text` checks the head both tools name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from agent_tools.consumers.head_inputs import HeadInputs, HeadInputsConsumer
from agent_tools.families import StackFacts
from agent_tools.inspector import Encoded, Inspector, PassPlan
from agent_tools.loading import LoadedModel
from agent_tools.render import attention_heatmap
from agent_tools.stack_input import AttentionStack


class HeadArguments(Protocol):
    """A tool's arguments naming one head on a text."""

    model: str | None
    attention: AttentionStack | None
    text: str
    layer: int
    head: int


@dataclass(frozen=True)
class HeadOnText:
    """The head a tool rebuilds from its layer's input x, and the text encoded on its stack."""

    loaded: LoadedModel
    stack: StackFacts
    encoded: Encoded
    layer: int
    head: int

    def heatmap(self, inspector: Inspector, weights: Tensor, stem: str, title: str) -> str:
        """Draw a (T, T) map over the text's tokens into the artifact folder (``stem``: the file's name); its path."""
        path = inspector.artifact_path(stem, ".png")
        labels = self.encoded.query_labels()
        attention_heatmap(weights.tolist(), labels, labels, title, path)
        return str(path)


def head_on_text(inspector: Inspector, args: HeadArguments, cross_refusal: str) -> HeadOnText:
    """The model, stack, layer and head ``args`` name, checked, and the text encoded on that stack; a
    cross-attention stack is refused with ``cross_refusal`` (its keys are not projected from x)."""
    loaded = inspector.model(args.model)
    stack = inspector.attention_stack(loaded, args.attention)
    inspector.require_stack(loaded, stack, ("self", "encoder", "decoder"), cross_refusal)
    layer = inspector.check_layer(loaded, args.layer, stack)
    head = inspector.check_head(loaded, args.head, stack)
    return HeadOnText(loaded, stack, inspector.encode_on(loaded, args.text, stack), layer, head)


def plan_head_inputs(
    inspector: Inspector, loaded: LoadedModel, encoded: Encoded, layer: int, heads: list[int]
) -> PassPlan[HeadInputs]:
    """The pass over ``layer`` with its input recorded; ``finish`` returns ``heads[0]``'s checked inputs."""
    consumer = HeadInputsConsumer.for_heads(loaded.model, loaded.facts, layer, heads, stack=encoded.stack)
    inspector.check_budget(consumer.held_bytes(encoded.length), "this reconstruction")

    def finish(_output: object) -> HeadInputs:
        return consumer.inputs()

    return PassPlan(loaded, encoded, [consumer], finish, layers=[layer], record_inputs=True)
