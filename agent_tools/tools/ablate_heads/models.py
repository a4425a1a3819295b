"""ablate_heads' arguments and report, and the "L.H" head grammar its arguments use."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from agent_tools.analysis.ablation import BASELINE_DRAWS, TIE_MARGIN
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import check_index
from agent_tools.intervene import AblationMethod
from agent_tools.schemas import HeadRow, Report, Rounded, Rounded6, TextInput, head_label
from agent_tools.stack_input import StackInput, StackReport

DESCRIPTION = (
    "Remove heads (mean-ablation) and measure next-token KL, loss and top token vs as many random heads, with "
    "direct logit attribution. Use to test if heads matter."
)

_HEAD_STRING = re.compile(r"^\s*[Ll]?\s*(-?\d+)\s*(?:\.|:|[Hh]|\.[Hh])\s*(-?\d+|\*)\s*$")


class HeadRef(HeadRow):
    """One attention head: layer and query head, both 0-based."""

    model_config = ConfigDict(extra="forbid")


HEAD_FORMS = (
    '"18.8" (layer 18 head 8; "L18H8" works too, "18.*" = every head of layer 18), [18, 8] or {"layer": 18, "head": 8}'
)
HeadPair = Annotated[list[int], Field(min_length=2, max_length=2)]


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def head_forms(value: Any) -> Any:
    """Before validation of a heads argument: every form an agent may guess is accepted, and anything else is
    refused with one message naming the accepted forms (instead of one error per member of the union).

    A bare string is a list of one head, or of several separated by commas ("18.8, 3.0").
    """
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        raise PydanticCustomError("heads_form", "heads must be a list of heads, each {forms}", {"forms": HEAD_FORMS})
    if len(value) == 2 and all(_is_index(v) for v in value):
        context = {"layer": value[0], "head": value[1], "forms": HEAD_FORMS}
        msg = "a pair of numbers is one head, so heads needs it in a list: [[{layer}, {head}]] (each head: {forms})"
        raise PydanticCustomError("heads_form", msg, context)
    for index, item in enumerate(value):
        pair = isinstance(item, list | tuple) and len(item) == 2 and all(_is_index(v) for v in item)
        ref = isinstance(item, dict) and set(item) == {"layer", "head"} and all(_is_index(v) for v in item.values())
        spelled = isinstance(item, str) and _HEAD_STRING.match(item) is not None
        if not (spelled or isinstance(item, HeadRef) or pair or ref):
            context = {"index": index, "item": repr(item), "forms": HEAD_FORMS}
            raise PydanticCustomError(
                "head_form", "heads[{index}] {item} is not a head; write each head as {forms}", context
            )
    return [list(item) if isinstance(item, tuple) else item for item in value]


HeadsArgument = Annotated[list[str | HeadRef | HeadPair], BeforeValidator(head_forms)]


class AblateHeadsInput(TextInput, StackInput):
    heads: HeadsArgument = Field(min_length=1)  # the forms: the prompts' "Arguments" block, HEAD_FORMS in errors
    method: AblationMethod = Field(
        default="mean",
        description="mean: output → its mean over positions; resample: → its output on resample_text; zero: → 0",
    )
    resample_text: str | None = Field(default=None, min_length=1)
    baseline_draws: int = Field(
        default=BASELINE_DRAWS, ge=2, le=64, description="random sets of as many heads ablated for comparison"
    )
    seed: int = Field(default=0, ge=0, description="seeds the baseline's draws and the resample shuffle")
    top_k: int = Field(default=5, ge=1, le=50, description="positions with the largest effect listed")
    target_token: str | None = Field(
        default=None,
        min_length=1,
        description="the token the logit attribution explains",
    )


class PositionEffect(BaseModel):
    position: int = Field(description="the position whose output changed (for a causal LM: predicting position+1)")
    token: str
    value: Rounded6 = Field(description="KL(clean ‖ ablated) of the next-token distribution (nats), or 1 − cos")


class HeadLogit(HeadRow):
    logit: Rounded = Field(description="what the head writes into the target's logit at the last position")


class DirectLogitAttribution(BaseModel):
    token: str
    token_id: int
    logit: Rounded = Field(description="the target's logit after the text (clean model)")
    heads_total: Rounded = Field(description="Σ over every head's direct logit attribution")
    final_norm: str = Field(description="the final norm whose scale was frozen: layer_norm or rms_norm")
    frozen_scale: Rounded6 = Field(description="σ of the final residual at the last position, held fixed")
    method: str = Field(description="how the numbers are computed, and what they do not say")
    ablated: list[HeadLogit] = Field(description="the ablated heads' direct logit attribution")
    top_heads: list[HeadLogit] = Field(description="the heads with the largest |direct logit attribution|")
    layers: list[Rounded] = Field(description="per layer, Σ over its heads")


class AblationBaseline(BaseModel):
    """The same ablation on random sets of as many heads (not the ones named): mean ± sample sd over the draws."""

    draws: int
    heads_per_draw: int
    effect: tuple[Rounded6, Rounded6] = Field(
        description="(mean, sd) of the loss change (causal LM, nats) or of the pooled 1 − cos (encoder)"
    )
    kl_mean: tuple[Rounded6, Rounded6] | None = Field(default=None, description="(mean, sd) of the mean KL, nats")
    effect_direction: str = Field(
        description="raises / lowers / within: the named heads' effect against the draws' spread"
    )
    kl_size: str | None = Field(default=None, description="larger / smaller / within: the named heads' KL")
    rule: str


class AblationReport(Report, StackReport):
    heads: list[str] = Field(description='the ablated heads as "L.H"')
    method: AblationMethod
    measure: str = Field(description="next_token (causal LM: KL, loss, top token) or embedding (encoder: cosine)")
    tokens: int = Field(description="tokens in the text")
    kl_last_position: Rounded6 | None = Field(default=None, description="KL(P_clean ‖ P_ablated) at the last position")
    kl_mean: Rounded6 | None = Field(default=None, description="KL averaged over every position, nats")
    loss_clean: Rounded | None = Field(default=None, description="mean next-token loss on the text, nats")
    loss_ablated: Rounded | None = None
    loss_change: Rounded6 | None = Field(default=None, description="loss_ablated − loss_clean (> 0: the heads helped)")
    top_token_clean: str | None = Field(default=None, description="most likely next token after the text")
    top_token_ablated: str | None = None
    top_token_changed: bool | None = Field(default=None, description="the top token ids differ (tie or flip)")
    top_token_change: str | None = Field(
        default=None,
        description=f"same, tie (the new top leads the old by < {TIE_MARGIN} probability under the ablation) or flip",
    )
    top_token_probability_new: Rounded | None = Field(
        default=None, description="the ablated top token's probability with the heads ablated"
    )
    top_token_probability_clean: Rounded | None = Field(default=None, description="its probability, clean model")
    top_token_probability_ablated: Rounded | None = Field(
        default=None, description="the clean top token's probability with the heads ablated"
    )
    pooled_cosine_change: Rounded6 | None = Field(
        default=None, description="encoder: 1 − cos between the mean-pooled embeddings, clean vs ablated"
    )
    mean_token_cosine_change: Rounded6 | None = Field(default=None, description="encoder: mean over tokens of 1 − cos")
    largest_effects: list[PositionEffect] = Field(default_factory=list)
    baseline: AblationBaseline | None = Field(default=None, description="the same ablation on random heads")
    resample_source: str | None = Field(default=None, description="method resample: what was copied in")
    direct_logit_attribution: DirectLogitAttribution | None = Field(
        default=None, description="causal LM: every head's direct write into the target token's logit"
    )
    notes: list[str] = Field(default_factory=list, description="what could not be measured, and why")


def parse_heads(
    heads: Sequence[str | HeadRef | dict | Sequence[int]], num_layers: int, num_heads: int
) -> list[tuple[int, int]]:
    """Validate heads given as "L.H" strings, [layer, head] pairs or {layer, head}; ranges and duplicates are
    refused by name."""
    parsed: list[tuple[int, int]] = []
    for index, item in enumerate(heads):
        if isinstance(item, dict):
            item = HeadRef.model_validate(item)
        if isinstance(item, HeadRef):
            layer, head = item.layer, item.head
        elif isinstance(item, list | tuple):
            layer, head = item
        else:
            match = _HEAD_STRING.match(str(item))
            if not match:
                last = num_layers - 1
                msg = (
                    f'heads[{index}] {item!r} is not a head; write "L.H" with layer 0..{last} and head '
                    f'0..{num_heads - 1}, e.g. "{last}.0", or [{last}, 0] or {{"layer": {last}, "head": 0}}'
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
