"""ablate_heads' arguments and report, and the "L.H" head grammar its arguments use."""

from __future__ import annotations

import re
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from agent_tools.errors import InvalidInputError
from agent_tools.inspector import check_index
from agent_tools.intervene import AblationMethod
from agent_tools.prompt_trace import NextCall
from agent_tools.schemas import Report, TextInput, head_label

DESCRIPTION = (
    "Check whether attention heads matter: remove their contribution (zero or mean-ablate their output before "
    "the output projection) and report, for a causal LM, the KL of the next-token distribution at the last "
    "position and on average, the change in loss on the text and whether the top next token changes; for an "
    "encoder, how far the pooled embedding turns. For a causal LM it also gives every head's direct logit "
    "attribution to a target token (its output through W_O, the final norm with its scale frozen, and the "
    "unembedding). The model is restored exactly afterwards."
)

_HEAD_STRING = re.compile(r"^\s*[Ll]?\s*(-?\d+)\s*(?:\.|:|[Hh]|\.[Hh])\s*(-?\d+|\*)\s*$")


class HeadRef(BaseModel):
    """One attention head: layer and query head, both 0-based."""

    model_config = ConfigDict(extra="forbid")

    layer: int = Field(description="layer index, 0-based")
    head: int = Field(description="query head index, 0-based")


HEADS_DESCRIPTION = (
    'heads to remove, as "L.H" strings (e.g. "3.0" = layer 3 head 0; "L3H0" also works; "3.*" = every head of layer '
    '3) or {"layer": 3, "head": 0} objects; each at most once'
)


class AblateHeadsInput(TextInput):
    heads: list[str | HeadRef] = Field(min_length=1, description=HEADS_DESCRIPTION)
    method: AblationMethod = Field(
        default="zero",
        description=(
            "zero: the heads write nothing (their slice of the attention output before the output projection is "
            "set to 0); mean: their slice is set to its mean over this text's positions"
        ),
    )
    top_k: int = Field(default=5, ge=1, le=50, description="positions with the largest effect listed")
    target_token: str | None = Field(
        default=None,
        min_length=1,
        description="causal LM: the one token whose logit after the text direct logit attribution explains (mind "
        "a leading space); omitted = the clean model's top next token",
    )


class PositionEffect(BaseModel):
    position: int = Field(description="the position whose output changed (for a causal LM: predicting position+1)")
    token: str
    value: float = Field(description="KL(clean ‖ ablated) of the next-token distribution (nats), or 1 − cos")


class HeadLogit(BaseModel):
    layer: int
    head: int
    logit: float = Field(description="what the head writes into the target's logit at the last position")


class DirectLogitAttribution(BaseModel):
    token: str
    token_id: int
    logit: float = Field(description="the target's logit after the text (clean model)")
    heads_total: float = Field(description="Σ over every head's direct logit attribution")
    final_norm: str = Field(description="the final norm whose scale was frozen: layer_norm or rms_norm")
    frozen_scale: float = Field(description="σ of the final residual at the last position, held fixed")
    method: str = Field(description="how the numbers are computed, and what they do not say")
    ablated: list[HeadLogit] = Field(description="the ablated heads' direct logit attribution")
    top_heads: list[HeadLogit] = Field(description="the heads with the largest |direct logit attribution|")
    layers: list[float] = Field(description="per layer, Σ over its heads")


class AblationReport(Report):
    heads: list[str] = Field(description='the ablated heads as "L.H"')
    method: AblationMethod
    measure: str = Field(description="next_token (causal LM: KL, loss, top token) or embedding (encoder: cosine)")
    tokens: int = Field(description="tokens in the text")
    kl_last_position: float | None = Field(default=None, description="KL(P_clean ‖ P_ablated) at the last position")
    kl_mean: float | None = Field(default=None, description="KL averaged over every position, nats")
    loss_clean: float | None = Field(default=None, description="mean next-token loss on the text, nats")
    loss_ablated: float | None = None
    loss_change: float | None = Field(default=None, description="loss_ablated − loss_clean (> 0: the heads helped)")
    top_token_clean: str | None = Field(default=None, description="most likely next token after the text")
    top_token_ablated: str | None = None
    top_token_changed: bool | None = None
    top_token_probability_clean: float | None = Field(default=None, description="its probability, clean model")
    top_token_probability_ablated: float | None = Field(
        default=None, description="the clean top token's probability with the heads ablated"
    )
    pooled_cosine_change: float | None = Field(
        default=None, description="encoder: 1 − cos between the mean-pooled embeddings, clean vs ablated"
    )
    mean_token_cosine_change: float | None = Field(default=None, description="encoder: mean over tokens of 1 − cos")
    largest_effects: list[PositionEffect] = Field(default_factory=list)
    direct_logit_attribution: DirectLogitAttribution | None = Field(
        default=None, description="causal LM: every head's direct write into the target token's logit"
    )
    notes: list[str] = Field(default_factory=list, description="what could not be measured, and why")
    next_calls: list[NextCall] = Field(default_factory=list, description="calls that would confirm or refute the lead")


def parse_heads(heads: Sequence[str | HeadRef | dict], num_layers: int, num_heads: int) -> list[tuple[int, int]]:
    """Validate heads given as "L.H" strings or {layer, head}; ranges and duplicates are refused by name."""
    parsed: list[tuple[int, int]] = []
    for index, item in enumerate(heads):
        if isinstance(item, dict):
            item = HeadRef.model_validate(item)
        if isinstance(item, HeadRef):
            layer, head = item.layer, item.head
        else:
            match = _HEAD_STRING.match(str(item))
            if not match:
                msg = (
                    f'heads[{index}] {item!r} is not a head; write "L.H" with layer 0..{num_layers - 1} and head '
                    f'0..{num_heads - 1}, e.g. "{num_layers - 1}.0"'
                )
                raise InvalidInputError(msg, field="heads")
            layer = check_index(int(match.group(1)), num_layers, f"heads[{index}] layer")
            if match.group(2) == "*":
                parsed.extend((layer, head) for head in range(num_heads))
                continue
            head = int(match.group(2))
        check_index(layer, num_layers, f"heads[{index}] layer")
        check_index(head, num_heads, f"heads[{index}] head")
        parsed.append((layer, head))
    duplicates = sorted({h for h in parsed if parsed.count(h) > 1})
    if duplicates:
        shown = ", ".join(head_label(layer, head) for layer, head in duplicates)
        raise InvalidInputError(f"heads lists {shown} more than once; give each head once", field="heads")
    return parsed
