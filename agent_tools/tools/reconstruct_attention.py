"""reconstruct_attention: one head's attention rebuilt step by step from the layer's input, ending at the model's map.

Also home of the capture that both this tool and inspect_projections use: one forward pass that keeps the
layer's input, the rotary (cos, sin), the mask rows and the maps of the heads asked for — and a parity check
that the weights read from the model reproduce what the model computed (otherwise the tools refuse).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, Field

from agent_tools.analysis.projections import js_divergence, masked_softmax, top_key_agreement
from agent_tools.analysis.reconstruct import (
    ReconstructionStage,
    StageMap,
    positional_scores,
    reconstruction_stages,
    stage_measures,
)
from agent_tools.capture import LayerAttention
from agent_tools.errors import UnsupportedModelError
from agent_tools.inspector import Encoded, Inspector, PassPlan, text_digest
from agent_tools.loading import LoadedModel
from agent_tools.render import attention_heatmap
from agent_tools.schemas import Finding, Report, TextInput, Token, rounded
from agent_tools.tools.registry import ToolSpec
from agent_tools.weights import HeadProjections, head_projections

PARITY_TOLERANCE = 1e-5  # stage 5 must equal the model's weights to this (the contract)
REFUSE_ABOVE = 1e-3  # weights read from the model that miss the model's map by more are a layout we got wrong


# --- capture shared with inspect_projections ----------------------------------------------------------------
class HeadInputsConsumer:
    """Keeps, for one layer: the attention input, rotary (cos, sin), mask rows, the maps of ``heads``, the
    pre-mask scores of ``heads[0]`` and its KV head's keys and values. Nothing else survives the forward."""

    def __init__(self, layer: int, heads: list[int], kv_head: int) -> None:
        self.layer, self.heads, self.kv_head = layer, heads, kv_head
        self.layer_input: torch.Tensor | None = None
        self.rotary: tuple[torch.Tensor, torch.Tensor] | None = None
        self.mask_rows: list[torch.Tensor] = []
        self.weight_rows: list[torch.Tensor] = []
        self.score_rows: list[torch.Tensor] = []
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        self.scaling = 1.0
        self.softcap: float | None = None

    def on_layer(self, captured: LayerAttention) -> None:
        if captured.layer != self.layer:
            return
        if captured.query_start == 0:
            if captured.layer_input is None:
                msg = f"layer {self.layer}'s attention input could not be recorded for this family"
                raise UnsupportedModelError(msg)
            self.layer_input = captured.layer_input[0].detach().float().clone()  # (T, C)
            if captured.position_embeddings is not None:
                cos, sin = captured.position_embeddings
                self.rotary = (cos[0].float().clone(), sin[0].float().clone())  # (T, d_rot) each
            self.key = captured.key[0, self.kv_head].float().clone()  # (Tk, D)
            self.value = captured.value[0, self.kv_head].float().clone()  # (Tk, D)
            self.scaling, self.softcap = captured.scaling, captured.softcap
        if captured.mask is not None:
            self.mask_rows.append(captured.mask[0, 0].float().clone())  # (q, Tk)
        self.weight_rows.append(captured.weights[0, self.heads].float().clone())  # (len(heads), q, Tk)
        self.score_rows.append(captured.scores[0, self.heads[0]].float().clone())  # (q, Tk)


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
    errors: dict[str, float] = field(default_factory=dict)

    @property
    def effective_scale(self) -> float:
        """The factor q·kᵀ is really multiplied by (OPT folds it into the query projection)."""
        return self.scaling * self.projections.query_prescale

    def allowed(self) -> torch.Tensor:
        length = self.x.shape[0]
        if self.mask is None:
            return torch.ones(length, length, dtype=torch.bool)
        return self.mask > torch.finfo(self.mask.dtype).min / 2


def capture_head_inputs(
    inspector: Inspector, loaded: LoadedModel, encoded: Encoded, layer: int, heads: list[int]
) -> HeadInputs:
    """One forward pass keeping what reconstruct/inspect need for ``heads[0]`` (and the maps of ``heads``)."""
    return inspector.execute(plan_head_inputs(inspector, loaded, encoded, layer, heads))


def plan_head_inputs(
    inspector: Inspector, loaded: LoadedModel, encoded: Encoded, layer: int, heads: list[int]
) -> PassPlan[HeadInputs]:
    """:func:`capture_head_inputs` as a plan: the pass over ``layer`` with its input recorded, then the checks."""
    projections = head_projections(loaded.model, layer, heads[0])
    length = encoded.length
    inspector.check_budget((len(heads) + 32) * length * length * 4, "this reconstruction")  # stage maps, float64 temps
    consumer = HeadInputsConsumer(layer, heads, projections.kv_head)

    def finish(_output: object) -> HeadInputs:
        if consumer.layer_input is None or consumer.key is None or consumer.value is None:
            raise UnsupportedModelError(f"layer {layer} was not captured for this model")
        weights = torch.cat(consumer.weight_rows, dim=1)  # (len(heads), T, T)
        inputs = HeadInputs(
            x=consumer.layer_input,
            rotary=consumer.rotary,
            mask=torch.cat(consumer.mask_rows) if consumer.mask_rows else None,
            weights={h: weights[i] for i, h in enumerate(heads)},
            scores=torch.cat(consumer.score_rows),
            key=consumer.key,
            value=consumer.value,
            scaling=consumer.scaling,
            softcap=consumer.softcap,
            projections=projections,
        )
        check_parity(inputs, reconstruct(inputs))
        return inputs

    return PassPlan(loaded, encoded, [consumer], finish, layers=[layer], record_inputs=True)


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
    )


def check_parity(inputs: HeadInputs, stages: list[StageMap]) -> None:
    """Measure stage-4 scores, stage-5 weights and the values against what the model computed; refuse on a miss."""
    p = inputs.projections
    model_map = inputs.weights[p.head]
    errors = {
        "positional_scores": float((positional_scores(stages, inputs.softcap) - inputs.scores).abs().max()),
        "model_weights": float((stages[-1].weights - model_map).abs().max()),
        "values": float((p.values(inputs.x) - inputs.value).abs().max()),
    }
    inputs.errors.update(errors)
    value_scale = max(1.0, float(inputs.value.abs().max()))
    if errors["model_weights"] > REFUSE_ABOVE or errors["values"] > REFUSE_ABOVE * value_scale:
        msg = (
            f"the {p.family} weights read for layer {p.layer} head {p.head} do not reproduce the model's attention "
            f"(weight error {errors['model_weights']:.2e}, value error {errors['values']:.2e}); refusing rather than "
            "reporting wrong numbers"
        )
        raise UnsupportedModelError(msg, field="model")


def masked_map(stage: StageMap, inputs: HeadInputs) -> torch.Tensor:
    """(T, T) this stage's scores under the model's mask (stage 5 is already the model's map)."""
    if stage.stage == "model":
        return stage.weights
    return masked_softmax(stage.scores, inputs.mask)


def describe_mask(allowed: torch.Tensor) -> str:
    """Name what the mask does from the mask itself: none, causal, sliding window, padding."""
    length = allowed.shape[0]
    lower = torch.ones(length, length, dtype=torch.bool).tril()
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


# --- the tool ----------------------------------------------------------------------------------------------
class ReconstructAttentionInput(TextInput):
    layer: int = Field(description="layer index, 0-based (describe_model gives the range)")
    head: int = Field(description="query head index, 0-based")
    mask_every_stage: bool = Field(
        default=False,
        description="apply the mask to stages 1–4 too (on causal models this isolates the other pieces); "
        "by default the mask enters only at stage 5, as in the recipe",
    )
    png: bool = Field(default=False, description="write each stage's map as a PNG heatmap into the artifact folder")


class QueryTopKey(BaseModel):
    position: int = Field(description="query position")
    token: str
    key_position: int = Field(description="the key this query weights most at this stage")
    key_token: str
    weight: float


class StageReport(BaseModel):
    stage: int = Field(description="1..5")
    name: ReconstructionStage
    added: str = Field(description="what this stage adds to the previous one")
    scale: float = Field(description="factor the dot products are multiplied by at this stage")
    masked: bool = Field(description="whether the model's mask is applied at this stage")
    mean_entropy: float = Field(description="mean entropy of the softmax rows, nats")
    mean_normalised_entropy: float = Field(description="mean entropy / log(keys visible): 0 one key, 1 uniform")
    mean_max_weight: float
    self_share: float = Field(description="mean weight a query puts on itself")
    logit_std: float = Field(description="mean over queries of the standard deviation of its logits")
    mean_js_to_model: float = Field(description="mean per-query Jensen–Shannon divergence to the model's map, nats")
    masked_js_to_model: float = Field(
        description="the same after applying the model's mask to this stage's scores: what is left to explain "
        "besides the mask (0 at stage 5)"
    )
    top_key_agreement: float = Field(description="fraction of queries whose top key is the model's top key")
    top_keys: list[QueryTopKey]
    png_path: str | None = None


class AttentionReconstruction(Report):
    layer: int
    head: int
    kv_head: int
    family: str
    hidden_size: int = Field(description="d of stage 2: the raw input has this many dimensions")
    head_dim: int
    scaling: float = Field(description="the model's factor on q·k (stages 3–5)")
    positional: str
    mask: str = Field(description="what the model's mask does on this text")
    softcap: float | None
    tokens: list[Token]
    stages: list[StageReport]
    positional_score_error: float = Field(
        description="max |stage-4 q·k·scale (soft-capped) − the model's captured pre-mask scores|"
    )
    model_weight_error: float = Field(description="max |stage-5 weights − the model's own attention weights|")
    matches_model: bool = Field(description=f"model_weight_error ≤ {PARITY_TOLERANCE}")


def _stage_descriptions(
    loaded: LoadedModel, inputs: HeadInputs, mask_text: str, *, mask_every_stage: bool
) -> list[str]:
    facts, p = loaded.facts, inputs.projections
    d = inputs.x.shape[-1]
    bias = " with biases b_Q, b_K" if p.b_q is not None or p.b_k is not None else ""
    prescale = f" (folded into W_Q by {p.family})" if p.query_prescale != 1.0 else ""
    if inputs.rotary is not None:
        rotary_dims = inputs.rotary[0].shape[-1]
        positions = (
            f"RoPE applied to q and k ({rotary_dims} of {p.d_head} dims rotated)"
            if rotary_dims < p.d_head
            else "RoPE applied to q and k (all dims rotated)"
        )
    else:
        positions = f"nothing new: {facts.positional} — positions are already in x, so this equals stage 3"
    early = f"; {mask_phrase(mask_text)} applied already" if mask_every_stage else ", every key visible"
    softcap = f"scores soft-capped to c·tanh(s/c) with c = {inputs.softcap}, then " if inputs.softcap else ""
    return [
        f"raw dot products x_i·x_j of the layer's input (d = {d}){early}",
        f"divided by sqrt(d) = sqrt({d}) (d = hidden size, the length of raw x)",
        f"q = x W_Q, k = x W_K{bias} ({p.d_head}-dim head), "
        f"scaled by the model's {inputs.effective_scale:.4g}{prescale}",
        positions,
        f"{softcap}{mask_phrase(mask_text)}, then softmax: the model's own attention",
    ]


def reconstruct_attention(inspector: Inspector, args: ReconstructAttentionInput) -> AttentionReconstruction:
    """Rebuild one head's attention in five stages and measure each: raw x·xᵀ, scaled by 1/sqrt(d),
    projected with W_Q/W_K, with positions (RoPE), with the mask (and soft-capping) → the model's map."""
    loaded = inspector.model(args.model)
    layer = inspector.check_layer(loaded, args.layer)
    head = inspector.check_head(loaded, args.head)
    encoded = inspector.encode(loaded, args.text)
    inputs = capture_head_inputs(inspector, loaded, encoded, layer, [head])
    stages = reconstruct(inputs, mask_every_stage=args.mask_every_stage)
    model_map = inputs.weights[head]
    tokens = encoded.tokens
    mask_text = describe_mask(inputs.allowed())
    added = _stage_descriptions(loaded, inputs, mask_text, mask_every_stage=args.mask_every_stage)
    reports: list[StageReport] = []
    for number, (stage, text) in enumerate(zip(stages, added, strict=True), start=1):
        measures = stage_measures(stage)
        top_keys = [
            QueryTopKey(
                position=q,
                token=tokens[q].text,
                key_position=int(key),
                key_token=tokens[int(key)].text,
                weight=rounded(weight),
            )
            for q, (key, weight) in enumerate(zip(measures.top_key.tolist(), measures.top_weight.tolist(), strict=True))
        ]
        png_path = None
        if args.png:
            path = inspector.artifact_path(
                f"reconstruct-{loaded.name}-L{layer}H{head}-{number}-{stage.stage}-{text_digest(args.text)}", ".png"
            )
            labels = encoded.labels()
            title = f"{loaded.name} L{layer}H{head} stage {number}: {stage.stage}"
            attention_heatmap(stage.weights.tolist(), labels, labels, title, path)
            png_path = str(path)
        reports.append(
            StageReport(
                stage=number,
                name=stage.stage,
                added=text,
                scale=rounded(stage.scale, 6),
                masked=stage.stage == "model" or args.mask_every_stage,
                mean_entropy=rounded(measures.mean_entropy),
                mean_normalised_entropy=rounded(measures.mean_normalised_entropy),
                mean_max_weight=rounded(measures.mean_max_weight),
                self_share=rounded(measures.self_share),
                logit_std=rounded(measures.logit_std),
                mean_js_to_model=rounded(float(js_divergence(stage.weights, model_map).mean())),
                masked_js_to_model=rounded(float(js_divergence(masked_map(stage, inputs), model_map).mean())),
                top_key_agreement=rounded(top_key_agreement(stage.weights, model_map)),
                top_keys=top_keys,
                png_path=png_path,
            )
        )
    weight_error = inputs.errors["model_weights"]
    score_error = inputs.errors["positional_scores"]
    findings = [
        Finding(
            kind=f"stage_{r.stage}_{r.name}",
            layer=layer,
            head=head,
            value=r.mean_entropy,
            detail=(
                f"stage {r.stage} ({r.name}): entropy {r.mean_entropy:.3f} nats, mean max weight "
                f"{r.mean_max_weight:.3f}, self-share {r.self_share:.3f}, JS to the model {r.mean_js_to_model:.3f}"
            ),
        )
        for r in reports
    ]
    # Which ingredient moves the map most towards the model's own, the mask held fixed (largest drop in masked JS).
    drops = [(reports[i - 1].masked_js_to_model - reports[i].masked_js_to_model, i) for i in range(1, len(reports))]
    drop, decisive = max(drops)
    findings.insert(
        0,
        Finding(
            kind="decisive_stage",
            layer=layer,
            head=head,
            value=rounded(drop),
            detail=(
                f"with the mask held fixed, stage {decisive + 1} ({reports[decisive].name}) moves the map most towards "
                f"the model's: JS divergence {reports[decisive - 1].masked_js_to_model:.3f} → "
                f"{reports[decisive].masked_js_to_model:.3f} nats"
            ),
        ),
    )
    findings.append(
        Finding(
            kind="reconstruction_error",
            layer=layer,
            head=head,
            value=weight_error,
            detail=f"stage 5 equals the model's weights to {weight_error:.1e} (stage-4 scores to {score_error:.1e})",
        )
    )
    first, last = reports[0], reports[-1]
    positions = "RoPE" if inputs.rotary is not None else "positions (already in x)"
    summary = (
        f"Layer {layer} head {head} rebuilt from its input on {encoded.length} tokens; mean entropy per stage: "
        f"raw x·xᵀ {first.mean_entropy:.3f} nats (self-share {first.self_share:.2f}) → ÷sqrt({inputs.x.shape[-1]}) "
        f"{reports[1].mean_entropy:.3f} → W_Q/W_K {reports[2].mean_entropy:.3f} → {positions} "
        f"{reports[3].mean_entropy:.3f} → {mask_phrase(mask_text)}{' and soft-cap' if inputs.softcap else ''}, "
        f"softmax {last.mean_entropy:.3f} = the model's map (max error {weight_error:.1e}). With the mask held "
        f"fixed, stage {decisive + 1} ({reports[decisive].name}) moves it most towards the model's map "
        f"(JS {reports[decisive - 1].masked_js_to_model:.3f} → {reports[decisive].masked_js_to_model:.3f} nats)."
    )
    return AttentionReconstruction(
        model=loaded.name,
        summary=summary,
        findings=findings,
        layer=layer,
        head=head,
        kv_head=inputs.projections.kv_head,
        family=loaded.facts.family,
        hidden_size=inputs.x.shape[-1],
        head_dim=inputs.projections.d_head,
        scaling=rounded(inputs.effective_scale, 6),
        positional=loaded.facts.positional,
        mask=mask_text,
        softcap=inputs.softcap,
        tokens=tokens,
        stages=reports,
        positional_score_error=score_error,
        model_weight_error=weight_error,
        matches_model=weight_error <= PARITY_TOLERANCE,
    )


SPEC = ToolSpec(
    name="reconstruct_attention",
    description=(
        "Rebuild one head's attention step by step from the layer's own input and measure each step: (1) raw "
        "dot products x·xᵀ, (2) scaled by 1/sqrt(d), (3) projected with W_Q and W_K, (4) with positions (RoPE), "
        "(5) with the causal/padding/sliding-window mask and soft-capping, then softmax — which equals the "
        "model's own map (the error is reported). Per stage: entropy, max weight, self-share, top key per query, "
        "divergence from the model's map; optional PNG per stage. Shows which ingredient makes the head attend "
        "the way it does."
    ),
    input_model=ReconstructAttentionInput,
    output_model=AttentionReconstruction,
    run=reconstruct_attention,
    example={"text": "The cat sat on the mat because it was tired.", "layer": 3, "head": 0},
)
