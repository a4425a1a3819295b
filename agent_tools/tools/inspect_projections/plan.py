"""inspect_projections' pass and numbers: the head's layer with its input recorded, then the projections measured.

The pass is :func:`agent_tools.head_inputs_pass.plan_head_inputs` over the head and the query heads sharing its
KV head (their maps are compared); ``finish`` measures the spectra and subspaces of the head's W_Q, W_K, W_V,
W_O (:mod:`agent_tools.layout`), the other heads' W_Q, and the counterfactual with no projections. The words
come from :mod:`.narrative`.
"""

from __future__ import annotations

import math

import torch

from agent_tools.analysis.metrics import js_divergence, normalised_entropy
from agent_tools.analysis.projections import (
    Spectrum,
    matrix_cosine,
    matrix_spectrum,
    mean_entropy,
    no_projection_attention,
    principal_angles,
    product_spectrum,
    qk_identity_alignment,
    qk_symmetric_share,
    random_subspace_cos2,
    self_argmax_fraction,
    self_copy_cosine,
    self_share,
    top_key_agreement,
)
from agent_tools.consumers.head_inputs import HeadInputs, describe_mask
from agent_tools.head_inputs_pass import HeadOnText, head_on_text, plan_head_inputs
from agent_tools.inspector import Inspector, PassPlan, text_digest
from agent_tools.layout import HeadProjections, head_projections
from agent_tools.stack_input import on_stack
from agent_tools.tools.inspect_projections.models import (
    EFFECTIVE_RANK_DEFINITION,
    CounterfactualRow,
    InspectProjectionsInput,
    MatrixSpectrumReport,
    NoProjectionCounterfactual,
    ProjectionReport,
    SharedKVHead,
    SubspaceAngles,
)
from agent_tools.tools.inspect_projections.narrative import Measured, findings, summary

CROSS_REFUSAL = (
    "inspect_projections rebuilds a head from one input x (Q = K = V = x for its counterfactual); a "
    "cross-attention head's keys and values come from the encoder's output, not from x"
)


def plan_inspect_projections(inspector: Inspector, args: InspectProjectionsInput) -> PassPlan[ProjectionReport]:
    """Compare one head's W_Q, W_K, W_V, W_O (norms, singular values, effective rank, principal angles), the
    query heads sharing its KV head, and the attention it would have with Q = K = V = the layer's input: the pass
    over the head's layer (its input recorded) and the report built from it."""
    target = head_on_text(inspector, args, CROSS_REFUSAL)
    stack, head = target.stack, target.head
    others = [h for h in stack.heads_sharing_kv(stack.kv_head_of(head)) if h != head]
    capture = plan_head_inputs(inspector, target.loaded, target.encoded, target.layer, [head, *others])
    return capture.then(lambda inputs: _report(inspector, args, target, inputs, others))


def _report(
    inspector: Inspector, args: InspectProjectionsInput, target: HeadOnText, inputs: HeadInputs, others: list[int]
) -> ProjectionReport:
    p, stack = inputs.projections, target.stack
    symmetric, identity = qk_symmetric_share(p.w_q, p.w_k), qk_identity_alignment(p.w_q, p.w_k)
    counterfactual = no_projection_attention(inputs.x, inputs.effective_scale, inputs.mask)  # (T, T)
    png_path = None
    if args.png:
        name, where = target.loaded.name, f"L{target.layer}H{target.head}"
        png_path = target.heatmap(
            inspector,
            counterfactual,
            f"no-projection-{name}-{where}-{text_digest(args.text)}",
            f"{name} {where}: Q = K = V = x (no projections), scale {inputs.effective_scale:.4g}",
        )
    report = ProjectionReport(
        model=target.loaded.name,
        summary="",
        findings=[],
        attention=stack.name,
        layer=target.layer,
        head=target.head,
        kv_head=stack.kv_head_of(target.head),
        family=p.family,
        hidden_size=p.d_model,
        head_dim=p.d_head,
        tokens=target.encoded.query_tokens,
        effective_rank_definition=EFFECTIVE_RANK_DEFINITION,
        matrices=_matrices(p),
        query_key_angles=_angles("W_Q", "W_K", p.w_q, p.w_k),
        qk_symmetric_share=symmetric,
        qk_identity_alignment=identity,
        heads_sharing_kv=stack.heads_sharing_kv(stack.kv_head_of(target.head)),
        shared_kv_heads=_shared_kv_heads(target, inputs, others),
        counterfactual=_counterfactual(target, inputs, counterfactual, png_path),
        model_weight_error=inputs.errors["model_weights"],
    )
    measured = Measured(report, symmetric, identity, inputs.effective_scale)
    return report.model_copy(update={"summary": on_stack(stack.name, summary(report)), "findings": findings(measured)})


def _spectrum_report(
    name: str, spectrum: Spectrum, shape: list[int], bias: torch.Tensor | None
) -> MatrixSpectrumReport:
    return MatrixSpectrumReport.model_validate(
        vars(spectrum)  # the norms and ranks, by the row's names
        | {
            "name": name,
            "shape": shape,
            "bias_norm": float(bias.norm()) if bias is not None else None,
            "singular_values": spectrum.singular_values.tolist(),
        }
    )


def _matrices(p: HeadProjections) -> list[MatrixSpectrumReport]:
    """Spectra of W_Q, W_K, W_V, W_O and of the QK and OV circuits, in that order."""
    d_model, d_head = p.d_model, p.d_head
    return [
        _spectrum_report("W_Q", matrix_spectrum(p.w_q), [d_model, d_head], p.b_q),
        _spectrum_report("W_K", matrix_spectrum(p.w_k), [d_model, d_head], p.b_k),
        _spectrum_report("W_V", matrix_spectrum(p.w_v), [d_model, d_head], p.b_v),
        _spectrum_report("W_O", matrix_spectrum(p.w_o), [d_head, d_model], None),
        _spectrum_report("W_Q·W_Kᵀ (QK circuit)", product_spectrum(p.w_q, p.w_k), [d_model, d_model], None),
        _spectrum_report("W_V·W_O (OV circuit)", product_spectrum(p.w_v, p.w_o.T), [d_model, d_model], None),
    ]


def _angles(first: str, second: str, a: torch.Tensor, b: torch.Tensor) -> SubspaceAngles:
    angles = torch.rad2deg(principal_angles(a, b))  # (r,) ascending
    cos2 = torch.cos(torch.deg2rad(angles)).square()
    return SubspaceAngles(
        first=first,
        second=second,
        angles_deg=angles.tolist(),
        smallest_deg=float(angles.min()),
        median_deg=float(angles.median()),
        largest_deg=float(angles.max()),
        mean_cos2=float(cos2.mean()),
        random_mean_cos2=random_subspace_cos2(a.shape[1], b.shape[1], a.shape[0]),
    )


def _shared_kv_heads(target: HeadOnText, inputs: HeadInputs, others: list[int]) -> list[SharedKVHead]:
    """How each other query head reading the same K and V compares: its W_Q and its map."""
    w_q = inputs.projections.w_q
    model_map = inputs.weights[target.head]  # (T, T)
    reports = []
    for other in others:
        other_w_q = head_projections(
            target.loaded.model, target.layer, other, facts=target.loaded.facts, stack=target.encoded.stack
        ).w_q
        other_map = inputs.weights[other]
        other_angles = principal_angles(w_q, other_w_q)
        reports.append(
            SharedKVHead(
                head=other,
                w_q_cosine=matrix_cosine(w_q, other_w_q),
                w_q_mean_cos2=float(torch.cos(other_angles).square().mean()),
                w_q_smallest_angle_deg=math.degrees(float(other_angles.min())),
                map_js_divergence=float(js_divergence(model_map, other_map).mean()),
                top_key_agreement=top_key_agreement(model_map, other_map),
                mean_entropy=mean_entropy(other_map),
            )
        )
    return reports


def _counterfactual(
    target: HeadOnText, inputs: HeadInputs, counterfactual: torch.Tensor, png_path: str | None
) -> NoProjectionCounterfactual:
    """The (T, T) map with Q = K = V = x (the model's scale and mask) against the model's, per query and overall."""
    model_map = inputs.weights[target.head]  # (T, T)
    allowed = inputs.allowed()
    js_rows = js_divergence(model_map, counterfactual)  # (T,)
    return NoProjectionCounterfactual(
        scale=inputs.effective_scale,
        mask=describe_mask(allowed),
        mean_entropy=mean_entropy(counterfactual),
        mean_normalised_entropy=float(normalised_entropy(counterfactual.double(), allowed).mean()),
        self_argmax_fraction=self_argmax_fraction(counterfactual, allowed),
        self_share=self_share(counterfactual),
        self_copy_cosine=self_copy_cosine(counterfactual, inputs.x),
        model_mean_entropy=mean_entropy(model_map),
        model_mean_normalised_entropy=float(normalised_entropy(model_map.double(), allowed).mean()),
        model_self_argmax_fraction=self_argmax_fraction(model_map, allowed),
        model_self_share=self_share(model_map),
        mean_js_divergence=float(js_rows.mean()),
        max_js_divergence=float(js_rows.max()),
        max_js_position=int(js_rows.argmax()),
        top_key_agreement=top_key_agreement(model_map, counterfactual),
        rows=_counterfactual_rows(target, model_map, counterfactual, js_rows),
        png_path=png_path,
    )


def _counterfactual_rows(
    target: HeadOnText, model_map: torch.Tensor, counterfactual: torch.Tensor, js_rows: torch.Tensor
) -> list[CounterfactualRow]:
    """Per query: its divergence and top key with and without the projections."""
    tokens = target.encoded.query_tokens  # = the key tokens: a self-attention stack
    model_top, cf_top = model_map.argmax(-1), counterfactual.argmax(-1)  # (T,) each
    return [
        CounterfactualRow(
            position=q,
            token=tokens[q].text,
            js_divergence=float(js_rows[q]),
            model_top_key=int(model_top[q]),
            model_top_token=tokens[int(model_top[q])].text,
            counterfactual_top_key=int(cf_top[q]),
            counterfactual_top_token=tokens[int(cf_top[q])].text,
            counterfactual_self_weight=float(counterfactual[q, q]),
        )
        for q in range(len(tokens))
    ]
