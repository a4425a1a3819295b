"""reconstruct_attention's pass and numbers: one forward keeping the head's inputs, five stages, their measures.

The pass is :func:`agent_tools.head_inputs_pass.plan_head_inputs`, declared as a :class:`PassPlan` so ``analyze``
shares it with the focus layer's other tools (it refuses when the weights read from the model do not reproduce
its map); each stage is then measured (:func:`~agent_tools.analysis.reconstruct.stage_measures`,
divergence from the model's map) and optionally drawn. The words come from :mod:`.narrative`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_tools.analysis.metrics import js_divergence, masked_softmax
from agent_tools.analysis.projections import top_key_agreement
from agent_tools.analysis.reconstruct import StageMap, stage_measures
from agent_tools.consumers.head_inputs import HeadInputs, describe_mask, reconstruct
from agent_tools.families import SINK_LOGIT
from agent_tools.head_inputs_pass import HeadOnText, head_on_text, plan_head_inputs
from agent_tools.inspector import Inspector, PassPlan, text_digest
from agent_tools.stack_input import on_stack
from agent_tools.tools.reconstruct_attention.models import (
    PARITY_TOLERANCE,
    AttentionReconstruction,
    HeadSinkShare,
    QueryTopKey,
    ReconstructAttentionInput,
    StageReport,
)
from agent_tools.tools.reconstruct_attention.narrative import (
    Recipe,
    findings,
    stage_descriptions,
    summary,
)


@dataclass(frozen=True)
class Reconstruction:
    """The report and the tensors it was measured from: the stages and the head's inputs. The ``analyze`` job
    draws its pictures from them (they stay in the process; the report holds plain numbers)."""

    report: AttentionReconstruction
    stages: list[StageMap]
    inputs: HeadInputs


CROSS_REFUSAL = (
    "reconstruct_attention rebuilds a head from the one input x its queries and keys are projected from; a "
    "cross-attention head's keys come from the encoder's output, not from x"
)


def plan_reconstruct_attention(
    inspector: Inspector, args: ReconstructAttentionInput
) -> PassPlan[AttentionReconstruction]:
    """Rebuild one head's attention in five stages and measure each: raw x·xᵀ, divided by sqrt(d_k),
    projected with W_Q/W_K, with positions (RoPE), with the mask (and soft-capping) → the model's map.

    The pass over the head's layer (its input recorded) and the report built from it: shareable in ``analyze``."""
    return plan_reconstruction(inspector, args).then(lambda reconstruction: reconstruction.report)


def plan_reconstruction(inspector: Inspector, args: ReconstructAttentionInput) -> PassPlan[Reconstruction]:
    """The same pass, finishing with the report *and* the stage tensors (for the ``analyze`` job's pictures)."""
    target = head_on_text(inspector, args, CROSS_REFUSAL)
    capture = plan_head_inputs(inspector, target.loaded, target.encoded, target.layer, [target.head])

    def finish(inputs: HeadInputs) -> Reconstruction:
        stages = reconstruct(inputs, mask_every_stage=args.mask_every_stage)
        recipe = _recipe(target, inputs, describe_mask(inputs.allowed()), mask_every_stage=args.mask_every_stage)
        digest = text_digest(args.text)
        reports = [
            _stage_report(
                target,
                inputs,
                number,
                stage,
                added,
                masked=stage.stage == "model" or args.mask_every_stage,
                png_path=_stage_png(inspector, target, number, stage, digest) if args.png else None,
            )
            for number, (stage, added) in enumerate(zip(stages, stage_descriptions(recipe), strict=True), start=1)
        ]
        return Reconstruction(_report(target, inputs, recipe, reports), stages, inputs)

    return capture.then(finish)


def _recipe(target: HeadOnText, inputs: HeadInputs, mask_text: str, *, mask_every_stage: bool) -> Recipe:
    """The ingredients the stages add, read from the pass and the model's facts."""
    p = inputs.projections
    shares = inputs.sink_shares
    return Recipe(
        family=p.family,
        hidden_size=inputs.x.shape[-1],
        head_dim=p.d_head,
        has_bias=p.b_q is not None or p.b_k is not None,
        query_prescale=p.query_prescale,
        effective_scale=inputs.effective_scale,
        rotary_dims=inputs.rotary[0].shape[-1] if inputs.rotary is not None else None,
        positional=target.loaded.facts.positional,
        softcap=inputs.softcap,
        mask=mask_text,
        mask_every_stage=mask_every_stage,
        terms=tuple(term for term in inputs.terms if term != SINK_LOGIT) if inputs.bias is not None else (),
        sink=inputs.sink,
        sink_share=float(shares[target.head]) if shares is not None else None,
    )


def _masked_map(stage: StageMap, inputs: HeadInputs) -> torch.Tensor:
    """(T, T) this stage's scores under the model's mask (stage 5 is already the model's map)."""
    if stage.stage == "model":
        return stage.weights
    return masked_softmax(stage.scores.float(), inputs.allowed() if inputs.mask is not None else None)


JS_ROW_BLOCK = 256  # query rows per block of the divergence (each block reads only the key columns it uses)


def mean_js(p: torch.Tensor, q: torch.Tensor, *, block: int = JS_ROW_BLOCK) -> float:
    """Mean over rows of ``js_divergence(p_i, q_i)`` for (T, T) maps, block by block of rows, each over the key
    columns where either map has weight (a causal block of rows i < b reads keys < b: about half the work).

    Columns where both rows are 0 add nothing to the divergence, so the result is the whole-row value.
    """
    total = 0.0
    for start in range(0, p.shape[0], block):
        rows = slice(start, start + block)
        used = (p[rows] > 0) | (q[rows] > 0)  # (b, T)
        columns = used.any(0).nonzero()
        width = int(columns.max()) + 1 if columns.numel() else 1
        total += float(js_divergence(p[rows, :width], q[rows, :width]).sum())
    return total / max(1, p.shape[0])


def _stage_report(
    target: HeadOnText,
    inputs: HeadInputs,
    number: int,
    stage: StageMap,
    added: str,
    *,
    masked: bool,
    png_path: str | None,
) -> StageReport:
    """One stage's measures and its distance to the model's map (with and without the model's mask)."""
    measures = stage_measures(stage)
    model_map = inputs.weights[target.head]
    js = mean_js(stage.weights, model_map)
    masked_js = js if masked else mean_js(_masked_map(stage, inputs), model_map)  # a masked stage: the same
    tokens = target.encoded.query_tokens  # = the key tokens: a self-attention stack
    top_keys = [  # one per query (thousands on long texts): built unvalidated, the whole report is checked after
        QueryTopKey.model_construct(
            position=q,
            token=tokens[q].text,
            key_position=int(key),
            key_token=tokens[int(key)].text,
            weight=weight,
        )
        for q, (key, weight) in enumerate(zip(measures.top_key.tolist(), measures.top_weight.tolist(), strict=True))
    ]
    return StageReport.model_validate(
        vars(measures)  # its entropy, peak, self-share and logit spread, by the row's names
        | {
            "stage": number,
            "name": stage.stage,
            "added": added,
            "scale": stage.scale,
            "divisor": stage.divisor,
            "masked": masked,
            "mean_js_to_model": js,
            "masked_js_to_model": masked_js,
            "top_key_agreement": top_key_agreement(stage.weights, model_map),
            "top_keys": top_keys,
            "png_path": png_path,
        }
    )


def _stage_png(inspector: Inspector, target: HeadOnText, number: int, stage: StageMap, digest: str) -> str:
    """Draw one stage's map into the artifact folder; its path (``digest``: the text's, for the file name)."""
    where = f"{target.loaded.name}-L{target.layer}H{target.head}"
    title = f"{target.loaded.name} L{target.layer}H{target.head} stage {number}: {stage.stage}"
    return target.heatmap(inspector, stage.weights, f"reconstruct-{where}-{number}-{stage.stage}-{digest}", title)


def _report(
    target: HeadOnText, inputs: HeadInputs, recipe: Recipe, reports: list[StageReport]
) -> AttentionReconstruction:
    facts = target.loaded.facts
    stack = target.encoded.stack or facts.default_stack
    weight_error = inputs.errors["model_weights"]
    report = AttentionReconstruction(
        model=target.loaded.name,
        summary="",
        findings=[],
        attention=stack,
        layer=target.layer,
        head=target.head,
        kv_head=inputs.projections.kv_head,
        family=facts.family,
        hidden_size=recipe.hidden_size,
        head_dim=recipe.head_dim,
        scaling=inputs.effective_scale,
        positional=facts.positional,
        mask=recipe.mask,
        softcap=inputs.softcap,
        tokens=target.encoded.query_tokens,
        stages=reports,
        positional_score_error=inputs.errors["positional_scores"],
        model_weight_error=weight_error,
        matches_model=weight_error <= PARITY_TOLERANCE,
        score_terms=list(inputs.terms),
        head_sinks=_head_sinks(inputs),
    )
    return report.model_copy(update={"summary": on_stack(stack, summary(recipe, report)), "findings": findings(report)})


def _head_sinks(inputs: HeadInputs) -> list[HeadSinkShare]:
    """Every head's learned sink logit and the share it takes, beside its first-token share (GPT-OSS)."""
    logits, shares, firsts = inputs.sink_logits, inputs.sink_shares, inputs.first_token_shares
    if logits is None or shares is None or firsts is None:
        return []
    return [
        HeadSinkShare(
            head=head,
            sink_logit=float(logits[head]),
            sink_share=float(shares[head]),
            first_token_share=float(firsts[head]),
        )
        for head in range(logits.shape[0])
    ]
