"""One head's inputs from one forward pass, and the check that the weights read from the model reproduce it.

Shared by ``reconstruct_attention`` and ``inspect_projections``: the pass keeps the layer's input, the rotary
(cos, sin), the mask rows and the maps of the heads asked for; :meth:`HeadInputsConsumer.inputs` then rebuilds
the head from its own W_Q/W_K (:mod:`agent_tools.layout`) and refuses when that misses what the model computed:
a weight layout we got wrong must not produce plausible-looking numbers. What it keeps stays on the layer's device,
beside the head's weights, where the reconstruction runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from agent_tools.analysis.metrics import allowed_from_additive_mask
from agent_tools.analysis.reconstruct import StageMap, positional_scores, reconstruction_stages
from agent_tools.capture import LayerAttention
from agent_tools.errors import UnsupportedModelError
from agent_tools.families import ModelFacts
from agent_tools.layout import HeadProjections, head_projections

# Weights read from the model that miss the model's map by more are a layout we got wrong. The rebuild runs in
# float32 from weights stored in the model's dtype: a bf16/fp16 model's own map is rounded to ~2⁻⁸ / 2⁻¹¹ and peaked
# rows amplify that, while a wrong layout misses by 0.5–1.0, so each dtype gets its own bound.
REFUSE_ABOVE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
# Families whose rotary embedding hands (cos, sin) of half the head's width and rotates its two halves
# (GPT-OSS ``_apply_rotary_emb``): the same rotation as rotate_half with cos/sin repeated to the full width.
HALF_ROTARY_FAMILIES = frozenset({"gpt_oss"})
STAGE_MAP_COPIES = 32  # (T, T) float32 maps a reconstruction holds besides the captured ones (stages, float64 temps)


@dataclass
class HeadInputs:
    """What one forward pass gave us about one head (tensors stay inside the service layer)."""

    x: torch.Tensor  # (T, C) input of the attention module
    rotary: tuple[torch.Tensor, torch.Tensor] | None  # (T, d_rot) each
    mask: torch.Tensor | None  # (T, T) additive
    weights: dict[int, torch.Tensor]  # head -> (T, T) the model's map
    scores: torch.Tensor  # (T, T) the model's pre-mask scores (soft-capped) of the main head
    key: torch.Tensor  # (T, D) the KV head's keys after positions
    value: torch.Tensor  # (T, D)
    scaling: float  # the factor the attention function used
    softcap: float | None
    projections: HeadProjections
    dtype: torch.dtype = torch.float32  # the model's dtype: it sets how closely the rebuild must match
    errors: dict[str, float] = field(default_factory=dict)
    terms: tuple[str, ...] = ()  # the additive score terms the family adds (LayerAttention.terms)
    bias: torch.Tensor | None = None  # (T, T) the main head's additive term (already in ``scores``)
    sink: float | None = None  # the main head's learned sink logit (GPT-OSS)
    sink_logits: torch.Tensor | None = None  # (H,) every head's sink logit
    sink_shares: torch.Tensor | None = None  # (H,) mean over rows of the weight each head's sink column takes
    first_token_shares: torch.Tensor | None = None  # (H,) mean over rows of each head's weight on key 0

    @property
    def effective_scale(self) -> float:
        """The factor q·kᵀ is really multiplied by (OPT folds it into the query projection)."""
        return self.scaling * self.projections.query_prescale

    def allowed(self) -> torch.Tensor:
        length = self.x.shape[0]
        if self.mask is None:
            return torch.ones(length, length, dtype=torch.bool, device=self.x.device)
        return allowed_from_additive_mask(self.mask)


class HeadInputsConsumer:
    """Keeps, for one layer: the attention input, rotary (cos, sin), mask rows, the maps of ``heads``, the
    pre-mask scores of ``heads[0]`` and its KV head's keys and values. Nothing else survives the forward.

    Build it with :meth:`for_heads` (which reads ``heads[0]``'s weights, refusing unsupported layouts before
    any pass); the pass must record the layer's input (``record_inputs=True``).
    """

    accepts_key_prefix: ClassVar[bool] = False

    def __init__(self, layer: int, heads: list[int], projections: HeadProjections) -> None:
        self.layer, self.heads, self.projections = layer, heads, projections
        self.kv_head = projections.kv_head
        self.kept: dict[str, Any] = {}  # HeadInputs' fields the first chunk carries for the whole layer
        self.mask_rows: list[torch.Tensor] = []
        self.weight_rows: list[torch.Tensor] = []
        self.score_rows: list[torch.Tensor] = []
        self.bias_rows: list[torch.Tensor] = []
        self.sink_sums: torch.Tensor | None = None  # (H,) over rows
        self.first_sums: torch.Tensor | None = None  # (H,) over rows
        self.rows = 0

    @classmethod
    def for_heads(
        cls, model: torch.nn.Module, facts: ModelFacts, layer: int, heads: list[int], *, stack: str | None = None
    ) -> HeadInputsConsumer:
        """The consumer for ``heads`` of ``layer`` of ``stack`` (``heads[0]`` is the one rebuilt and checked)."""
        return cls(layer, heads, head_projections(model, layer, heads[0], facts=facts, stack=stack))

    def held_bytes(self, length: int) -> int:
        """What the pass and the reconstruction hold for a text of ``length`` tokens (for the memory budget)."""
        return (len(self.heads) + STAGE_MAP_COPIES) * length * length * 4

    def on_layer(self, captured: LayerAttention) -> None:
        if captured.layer != self.layer:
            return
        if captured.query_start == 0:
            self._keep_layer(captured)
        if captured.mask is not None:
            # as float32 0 / float32-min: an fp16 mask's −65504 would not read as "hidden" once upcast
            hidden = ~allowed_from_additive_mask(captured.mask[0, 0])  # (q, Tk)
            zeros = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            self.mask_rows.append(zeros.masked_fill(hidden, torch.finfo(torch.float32).min))  # (q, Tk)
        self.weight_rows.append(captured.weights[0, self.heads].float().clone())  # (len(heads), q, Tk)
        self.score_rows.append(captured.scores[0, self.heads[0]].float().clone())  # (q, Tk)
        if captured.bias is not None:
            bias = captured.bias[0, self.heads[0]].float()  # (q or 1, Tk): batch 0 (or the shared 1)
            self.bias_rows.append(bias.expand(captured.weights.shape[2], bias.shape[-1]).clone())  # (q, Tk)
        if captured.sink_logits is not None:
            shares = captured.sink_share()[0].float().sum(-1)  # (H,)
            firsts = captured.weights[0, :, :, 0].float().sum(-1)  # (H,)
            self.sink_sums = shares if self.sink_sums is None else self.sink_sums + shares
            self.first_sums = firsts if self.first_sums is None else self.first_sums + firsts
        self.rows += captured.weights.shape[2]

    def _keep_layer(self, captured: LayerAttention) -> None:
        """What the first chunk carries for the whole layer: its input, positions, keys and values."""
        if captured.layer_input is None:
            msg = f"layer {self.layer}'s attention input could not be recorded for this family"
            raise UnsupportedModelError(msg)
        rotary = None
        if captured.position_embeddings is not None:
            cos, sin = captured.position_embeddings
            cos, sin = cos[0].float(), sin[0].float()  # (T, d_rot) each
            if self.projections.family in HALF_ROTARY_FAMILIES and 2 * cos.shape[-1] == self.projections.d_head:
                # GPT-OSS rotates (x₁, x₂) halves with half-width cos/sin: the rotate_half form with them repeated
                cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
            rotary = (cos.clone(), sin.clone())
        sink_logits = None
        if captured.sink_logits is not None:
            sink_logits = captured.sink_logits.detach().float().cpu().clone()  # (H,)
        self.kept = {
            "x": captured.layer_input[0].detach().float().clone(),  # (T, C)
            "rotary": rotary,
            "key": captured.key[0, self.kv_head].float().clone(),  # (Tk, D)
            "value": captured.value[0, self.kv_head].float().clone(),  # (Tk, D)
            "scaling": captured.scaling,
            "softcap": captured.softcap,
            "dtype": captured.weights.dtype,
            "terms": tuple(captured.terms),
            "sink_logits": sink_logits,
            "sink": float(sink_logits[self.heads[0]]) if sink_logits is not None else None,
        }

    def inputs(self) -> HeadInputs:
        """After the pass: the head's inputs, checked against the model (:func:`check_parity`)."""
        if not self.kept:
            raise UnsupportedModelError(f"layer {self.layer} was not captured for this model")
        weights = torch.cat(self.weight_rows, dim=1)  # (len(heads), T, T)
        inputs = HeadInputs(
            **self.kept,
            mask=torch.cat(self.mask_rows) if self.mask_rows else None,
            weights={h: weights[i] for i, h in enumerate(self.heads)},
            scores=torch.cat(self.score_rows),
            projections=self.projections,
            bias=torch.cat(self.bias_rows) if self.bias_rows else None,
            sink_shares=self.sink_sums / self.rows if self.sink_sums is not None else None,
            first_token_shares=self.first_sums / self.rows if self.first_sums is not None else None,
        )
        check_parity(inputs, reconstruct(inputs))
        return inputs


def reconstruct(inputs: HeadInputs, *, mask_every_stage: bool = False) -> list[StageMap]:
    """The five stages for the captured head, from its own weights and the layer's recorded input."""
    p = inputs.projections
    return reconstruction_stages(
        inputs.x,
        w_q=p.w_q,
        b_q=p.b_q,
        w_k=p.w_k,
        b_k=p.b_k,
        scaling=inputs.scaling,
        query_prescale=p.query_prescale,
        rotary=inputs.rotary,
        mask=inputs.mask,
        softcap=inputs.softcap,
        mask_every_stage=mask_every_stage,
        bias=inputs.bias,
        sink=inputs.sink,
    )


def check_parity(inputs: HeadInputs, stages: list[StageMap]) -> None:
    """Measure stage-4 scores, stage-5 weights and the values against what the model computed; refuse on a miss."""
    p = inputs.projections
    model_map = inputs.weights[p.head]
    errors = {
        "positional_scores": float(
            (positional_scores(stages, inputs.softcap, inputs.bias) - inputs.scores).abs().max()
        ),
        "model_weights": float((stages[-1].weights - model_map).abs().max()),
        "values": float((p.values(inputs.x) - inputs.value).abs().max()),
    }
    inputs.errors.update(errors)
    value_scale = max(1.0, float(inputs.value.abs().max()))
    bound = REFUSE_ABOVE.get(inputs.dtype, REFUSE_ABOVE[torch.float32])
    if errors["model_weights"] > bound or errors["values"] > bound * value_scale:
        msg = (
            f"the {p.family} weights read for layer {p.layer} head {p.head} do not reproduce the model's attention "
            f"(weight error {errors['model_weights']:.2e}, value error {errors['values']:.2e}); refusing rather than "
            "reporting wrong numbers"
        )
        raise UnsupportedModelError(msg, field="model")


def describe_mask(allowed: torch.Tensor) -> str:
    """Name what the mask does from the mask itself: none, causal, sliding window, padding."""
    length = allowed.shape[0]
    lower = torch.ones(length, length, dtype=torch.bool, device=allowed.device).tril()
    if bool(allowed.all()):
        return "none (every query reads every key)"
    if bool((allowed & ~lower).any()):
        return "padding (bidirectional otherwise)"
    if bool(allowed.equal(lower)):
        return "causal"
    window = int(allowed.sum(-1).max())
    return f"causal with a sliding window of {window} keys"


def mask_phrase(mask_text: str) -> str:
    """'the causal mask', 'no mask (every query reads every key)', ... for sentences."""
    return "no mask (every query reads every key)" if mask_text.startswith("none") else f"the {mask_text} mask"
