"""inspect_projections: how a head's W_Q, W_K, W_V (and W_O) differ, and what attention would be without them."""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, Field

from agent_tools.analysis.maps import normalised_entropy
from agent_tools.analysis.projections import (
    Spectrum,
    js_divergence,
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
from agent_tools.inspector import Encoded, Inspector, PassPlan, text_digest
from agent_tools.loading import LoadedModel
from agent_tools.render import attention_heatmap
from agent_tools.schemas import Finding, Report, TextInput, Token, rounded
from agent_tools.tools.reconstruct_attention import HeadInputs, describe_mask, mask_phrase, plan_head_inputs
from agent_tools.tools.registry import ToolSpec
from agent_tools.weights import head_projections

EFFECTIVE_RANK_DEFINITION = (
    "Roy & Vetterli (2007) entropy effective rank: exp(−Σ p_i ln p_i) with p_i = σ_i / Σσ; equals the rank when "
    "all non-zero singular values are equal, 1 for a rank-one matrix. stable_rank = ‖W‖_F² / ‖W‖_2²."
)


class InspectProjectionsInput(TextInput):
    layer: int = Field(description="layer index, 0-based (describe_model gives the range)")
    head: int = Field(description="query head index, 0-based")
    png: bool = Field(
        default=False, description="write the no-projection counterfactual map as a PNG into the artifact folder"
    )


class MatrixSpectrumReport(BaseModel):
    name: str = Field(description="W_Q, W_K, W_V, W_O, or a circuit: W_Q·W_Kᵀ (QK), W_V·W_O (OV)")
    shape: list[int] = Field(description="rows × columns in the x @ W convention (d_model × d_head for W_Q)")
    frobenius_norm: float
    spectral_norm: float = Field(description="largest singular value")
    effective_rank: float = Field(description="Roy & Vetterli entropy effective rank (see effective_rank_definition)")
    stable_rank: float = Field(description="‖W‖_F² / ‖W‖_2²")
    bias_norm: float | None = Field(default=None, description="norm of the bias slice, where the family has one")
    singular_values: list[float] = Field(description="descending")


class SubspaceAngles(BaseModel):
    first: str
    second: str
    angles_deg: list[float] = Field(description="principal angles, ascending, degrees (0 shared, 90 orthogonal)")
    smallest_deg: float
    median_deg: float
    largest_deg: float
    mean_cos2: float = Field(description="mean cos² of the angles: 1 same subspace, 0 orthogonal")
    random_mean_cos2: float = Field(description="mean cos² expected for random subspaces of these sizes")


class SharedKVHead(BaseModel):
    head: int = Field(description="another query head reading the same K and V")
    w_q_cosine: float = Field(description="cosine between the two heads' W_Q slices (flattened)")
    w_q_mean_cos2: float = Field(description="mean cos² of the principal angles between their W_Q subspaces")
    w_q_smallest_angle_deg: float
    map_js_divergence: float = Field(description="mean per-query Jensen–Shannon divergence of the two maps, nats")
    top_key_agreement: float = Field(description="fraction of queries whose top key is the same in both maps")
    mean_entropy: float = Field(description="that head's mean entropy on this text, nats")


class CounterfactualRow(BaseModel):
    position: int
    token: str
    js_divergence: float = Field(description="Jensen–Shannon divergence between the model's row and the counterfactual")
    model_top_key: int
    model_top_token: str
    counterfactual_top_key: int
    counterfactual_top_token: str
    counterfactual_self_weight: float


class NoProjectionCounterfactual(BaseModel):
    scale: float = Field(description="the model's scale, applied to x·xᵀ")
    mask: str
    mean_entropy: float = Field(description="nats")
    mean_normalised_entropy: float
    self_argmax_fraction: float = Field(
        description="fraction of queries whose largest weight is on themselves (queries that can read only "
        "themselves, like the first token under a causal mask, are left out)"
    )
    self_share: float = Field(description="mean weight on the query itself")
    self_copy_cosine: float = Field(
        description="mean cosine between (A x)_i and x_i with V = x: how much it copies itself"
    )
    model_mean_entropy: float
    model_mean_normalised_entropy: float
    model_self_argmax_fraction: float
    model_self_share: float
    mean_js_divergence: float = Field(description="mean over queries, nats (maximum ln 2 ≈ 0.693)")
    max_js_divergence: float
    max_js_position: int
    top_key_agreement: float
    rows: list[CounterfactualRow]
    png_path: str | None = None


class ProjectionReport(Report):
    layer: int
    head: int
    kv_head: int
    family: str
    hidden_size: int
    head_dim: int
    tokens: list[Token]
    effective_rank_definition: str
    matrices: list[MatrixSpectrumReport]
    query_key_angles: SubspaceAngles = Field(
        description="principal angles between the input subspaces W_Q and W_K read from (column spaces in R^d_model): "
        "'what I am looking for' vs 'what I have to offer'"
    )
    qk_symmetric_share: float = Field(
        description="share of ‖W_Q W_Kᵀ‖_F² in its symmetric part (1 similarity-like, ≈0.5 random, 0 antisymmetric)"
    )
    qk_identity_alignment: float = Field(
        description="cosine between W_Q W_Kᵀ and the identity (1 = plain x·x, 0 unrelated, < 0 prefers dissimilar)"
    )
    heads_sharing_kv: list[int] = Field(description="all query heads that read this head's KV head (itself included)")
    shared_kv_heads: list[SharedKVHead]
    counterfactual: NoProjectionCounterfactual
    model_weight_error: float = Field(
        description="parity check: max |softmax rebuilt from these weights − model's map|"
    )


def _spectrum_report(
    name: str, spectrum: Spectrum, shape: list[int], bias: torch.Tensor | None
) -> MatrixSpectrumReport:
    return MatrixSpectrumReport(
        name=name,
        shape=shape,
        frobenius_norm=rounded(spectrum.frobenius_norm),
        spectral_norm=rounded(spectrum.spectral_norm),
        effective_rank=rounded(spectrum.effective_rank),
        stable_rank=rounded(spectrum.stable_rank),
        bias_norm=rounded(float(bias.norm())) if bias is not None else None,
        singular_values=[rounded(v) for v in spectrum.singular_values.tolist()],
    )


def _angles(first: str, second: str, a: torch.Tensor, b: torch.Tensor) -> SubspaceAngles:
    angles = torch.rad2deg(principal_angles(a, b))  # (r,) ascending
    cos2 = torch.cos(torch.deg2rad(angles)).square()
    return SubspaceAngles(
        first=first,
        second=second,
        angles_deg=[rounded(v, 2) for v in angles.tolist()],
        smallest_deg=rounded(float(angles.min()), 2),
        median_deg=rounded(float(angles.median()), 2),
        largest_deg=rounded(float(angles.max()), 2),
        mean_cos2=rounded(float(cos2.mean())),
        random_mean_cos2=rounded(random_subspace_cos2(a.shape[1], b.shape[1], a.shape[0])),
    )


def inspect_projections(inspector: Inspector, args: InspectProjectionsInput) -> ProjectionReport:
    """Compare one head's W_Q, W_K, W_V, W_O (norms, singular values, effective rank, principal angles), the
    query heads sharing its KV head, and the attention it would have with Q = K = V = the layer's input."""
    return inspector.execute(plan_inspect_projections(inspector, args))


def plan_inspect_projections(inspector: Inspector, args: InspectProjectionsInput) -> PassPlan[ProjectionReport]:
    """The pass over the head's layer (its input recorded) and the report built from it."""
    loaded = inspector.model(args.model)
    layer = inspector.check_layer(loaded, args.layer)
    head = inspector.check_head(loaded, args.head)
    encoded = inspector.encode(loaded, args.text)
    others = [h for h in loaded.facts.heads_sharing_kv(loaded.facts.kv_head_of(head)) if h != head]
    capture = plan_head_inputs(inspector, loaded, encoded, layer, [head, *others])

    def finish(output: object) -> ProjectionReport:
        return _report(inspector, args, loaded, encoded, layer, head, others, capture.finish(output))

    return PassPlan(loaded, encoded, capture.consumers, finish, layers=[layer], record_inputs=True)


def _report(
    inspector: Inspector,
    args: InspectProjectionsInput,
    loaded: LoadedModel,
    encoded: Encoded,
    layer: int,
    head: int,
    others: list[int],
    inputs: HeadInputs,
) -> ProjectionReport:
    facts = loaded.facts
    kv_head = facts.kv_head_of(head)
    sharing = facts.heads_sharing_kv(kv_head)
    p = inputs.projections
    tokens = encoded.tokens
    d_model, d_head = p.d_model, p.d_head

    matrices = [
        _spectrum_report("W_Q", matrix_spectrum(p.w_q), [d_model, d_head], p.b_q),
        _spectrum_report("W_K", matrix_spectrum(p.w_k), [d_model, d_head], p.b_k),
        _spectrum_report("W_V", matrix_spectrum(p.w_v), [d_model, d_head], p.b_v),
        _spectrum_report("W_O", matrix_spectrum(p.w_o), [d_head, d_model], None),
        _spectrum_report("W_Q·W_Kᵀ (QK circuit)", product_spectrum(p.w_q, p.w_k), [d_model, d_model], None),
        _spectrum_report("W_V·W_O (OV circuit)", product_spectrum(p.w_v, p.w_o.T), [d_model, d_model], None),
    ]
    qk_angles = _angles("W_Q", "W_K", p.w_q, p.w_k)
    symmetric = qk_symmetric_share(p.w_q, p.w_k)
    identity = qk_identity_alignment(p.w_q, p.w_k)

    model_map = inputs.weights[head]  # (T, T)
    allowed = inputs.allowed()
    shared_reports = []
    for other in others:
        other_w_q = head_projections(loaded.model, layer, other).w_q
        other_map = inputs.weights[other]
        other_angles = principal_angles(p.w_q, other_w_q)
        shared_reports.append(
            SharedKVHead(
                head=other,
                w_q_cosine=rounded(matrix_cosine(p.w_q, other_w_q)),
                w_q_mean_cos2=rounded(float(torch.cos(other_angles).square().mean())),
                w_q_smallest_angle_deg=rounded(math.degrees(float(other_angles.min())), 2),
                map_js_divergence=rounded(float(js_divergence(model_map, other_map).mean())),
                top_key_agreement=rounded(top_key_agreement(model_map, other_map)),
                mean_entropy=rounded(mean_entropy(other_map)),
            )
        )

    scale = inputs.effective_scale
    counterfactual = no_projection_attention(inputs.x, scale, inputs.mask)  # (T, T)
    js_rows = js_divergence(model_map, counterfactual)  # (T,)
    model_top, cf_top = model_map.argmax(-1), counterfactual.argmax(-1)
    rows = [
        CounterfactualRow(
            position=q,
            token=tokens[q].text,
            js_divergence=rounded(float(js_rows[q])),
            model_top_key=int(model_top[q]),
            model_top_token=tokens[int(model_top[q])].text,
            counterfactual_top_key=int(cf_top[q]),
            counterfactual_top_token=tokens[int(cf_top[q])].text,
            counterfactual_self_weight=rounded(float(counterfactual[q, q])),
        )
        for q in range(encoded.length)
    ]
    mask_text = describe_mask(allowed)
    png_path = None
    if args.png:
        path = inspector.artifact_path(f"no-projection-{loaded.name}-L{layer}H{head}-{text_digest(args.text)}", ".png")
        labels = encoded.labels()
        title = f"{loaded.name} L{layer}H{head}: Q = K = V = x (no projections), scale {scale:.4g}"
        attention_heatmap(counterfactual.tolist(), labels, labels, title, path)
        png_path = str(path)
    worst = int(js_rows.argmax())
    cf = NoProjectionCounterfactual(
        scale=rounded(scale, 6),
        mask=mask_text,
        mean_entropy=rounded(mean_entropy(counterfactual)),
        mean_normalised_entropy=rounded(float(normalised_entropy(counterfactual.double(), allowed).mean())),
        self_argmax_fraction=rounded(self_argmax_fraction(counterfactual, allowed)),
        self_share=rounded(self_share(counterfactual)),
        self_copy_cosine=rounded(self_copy_cosine(counterfactual, inputs.x)),
        model_mean_entropy=rounded(mean_entropy(model_map)),
        model_mean_normalised_entropy=rounded(float(normalised_entropy(model_map.double(), allowed).mean())),
        model_self_argmax_fraction=rounded(self_argmax_fraction(model_map, allowed)),
        model_self_share=rounded(self_share(model_map)),
        mean_js_divergence=rounded(float(js_rows.mean())),
        max_js_divergence=rounded(float(js_rows.max())),
        max_js_position=worst,
        top_key_agreement=rounded(top_key_agreement(model_map, counterfactual)),
        rows=rows,
        png_path=png_path,
    )

    w_q, w_k, w_v = matrices[0], matrices[1], matrices[2]
    findings = [
        Finding(
            kind="projection_spectra",
            layer=layer,
            head=head,
            value=w_q.effective_rank,
            detail=(
                f"effective rank of {d_head} possible: W_Q {w_q.effective_rank:.1f}, W_K {w_k.effective_rank:.1f}, "
                f"W_V {w_v.effective_rank:.1f}, QK circuit {matrices[4].effective_rank:.1f}, "
                f"OV circuit {matrices[5].effective_rank:.1f}; spectral norms W_Q {w_q.spectral_norm:.3g}, "
                f"W_K {w_k.spectral_norm:.3g}, W_V {w_v.spectral_norm:.3g}"
            ),
        ),
        Finding(
            kind="query_key_subspaces",
            layer=layer,
            head=head,
            value=qk_angles.mean_cos2,
            detail=(
                f"W_Q and W_K read input subspaces with mean cos² {qk_angles.mean_cos2:.3f} (random: "
                f"{qk_angles.random_mean_cos2:.3f}); principal angles {qk_angles.smallest_deg:.1f}° to "
                f"{qk_angles.largest_deg:.1f}° (median {qk_angles.median_deg:.1f}°); W_Q·W_Kᵀ is {symmetric:.0%} "
                f"symmetric, identity alignment {identity:.3f}"
            ),
        ),
        Finding(
            kind="no_projection_counterfactual",
            layer=layer,
            head=head,
            value=cf.self_argmax_fraction,
            detail=(
                f"with Q = K = V = x (scale {scale:.4g}, {mask_phrase(mask_text)}) "
                f"{cf.self_argmax_fraction:.0%} of queries attend mostly to themselves "
                f"(model: {cf.model_self_argmax_fraction:.0%}); entropy "
                f"{cf.mean_entropy:.3f} vs the model's {cf.model_mean_entropy:.3f} nats; mean JS divergence "
                f"{cf.mean_js_divergence:.3f} nats"
            ),
        ),
        Finding(
            kind="largest_projection_effect",
            layer=layer,
            head=head,
            position=worst,
            token=tokens[worst].text,
            value=cf.max_js_divergence,
            detail=(
                f"the projections change query {worst} {tokens[worst].text!r} most "
                f"(JS {cf.max_js_divergence:.3f} nats): "
                f"it reads {rows[worst].model_top_token!r} (pos {rows[worst].model_top_key}) instead of "
                f"{rows[worst].counterfactual_top_token!r} (pos {rows[worst].counterfactual_top_key})"
            ),
        ),
    ]
    for shared in shared_reports:
        findings.append(
            Finding(
                kind="shared_kv_head",
                layer=layer,
                head=shared.head,
                value=shared.map_js_divergence,
                detail=(
                    f"head {shared.head} shares KV head {kv_head}: W_Q cosine {shared.w_q_cosine:.3f}, "
                    f"W_Q subspace mean cos² {shared.w_q_mean_cos2:.3f}, map JS divergence "
                    f"{shared.map_js_divergence:.3f} nats, same top key for {shared.top_key_agreement:.0%} of queries"
                ),
            )
        )
    if shared_reports:
        closest = min(shared_reports, key=lambda s: s.map_js_divergence)
        sharing_text = (
            f"It shares KV head {kv_head} with heads {', '.join(str(s.head) for s in shared_reports)}; the most "
            f"similar is head {closest.head} (map JS {closest.map_js_divergence:.3f} nats, W_Q cosine "
            f"{closest.w_q_cosine:.3f})."
        )
    else:
        sharing_text = f"It has its own K and V (no grouped-query attention in {p.family})."
    summary = (
        f"Layer {layer} head {head}: W_Q/W_K/W_V effective ranks {w_q.effective_rank:.1f}/{w_k.effective_rank:.1f}/"
        f"{w_v.effective_rank:.1f} of {d_head}; W_Q and W_K read subspaces with mean cos² {qk_angles.mean_cos2:.3f} "
        f"(random {qk_angles.random_mean_cos2:.3f}). Without projections (Q = K = V = x, same scale and mask) "
        f"{cf.self_argmax_fraction:.0%} of queries would attend mostly to themselves (model: "
        f"{cf.model_self_argmax_fraction:.0%}), entropy {cf.mean_entropy:.3f} vs {cf.model_mean_entropy:.3f} nats, "
        f"mean JS divergence {cf.mean_js_divergence:.3f} nats. {sharing_text}"
    )
    return ProjectionReport(
        model=loaded.name,
        summary=summary,
        findings=findings,
        layer=layer,
        head=head,
        kv_head=kv_head,
        family=p.family,
        hidden_size=d_model,
        head_dim=d_head,
        tokens=tokens,
        effective_rank_definition=EFFECTIVE_RANK_DEFINITION,
        matrices=matrices,
        query_key_angles=qk_angles,
        qk_symmetric_share=rounded(symmetric),
        qk_identity_alignment=rounded(identity),
        heads_sharing_kv=sharing,
        shared_kv_heads=shared_reports,
        counterfactual=cf,
        model_weight_error=inputs.errors["model_weights"],
    )


SPEC = ToolSpec(
    name="inspect_projections",
    description=(
        "Inspect one head's projections: norms, singular values and effective rank of W_Q, W_K, W_V, W_O and of "
        "the QK and OV circuits; principal angles between the input subspaces W_Q and W_K read ('what I look for' "
        "vs 'what I offer'); for grouped-query attention, the query heads sharing this KV head and how similar "
        "they are; and the counterfactual with no projections (Q = K = V = the layer's normalised input, same "
        "scale and mask): its entropy, how often a token attends to itself, and the per-query Jensen–Shannon "
        "divergence from the real head."
    ),
    input_model=InspectProjectionsInput,
    output_model=ProjectionReport,
    run=inspect_projections,
    plan=plan_inspect_projections,
    example={"text": "The cat sat on the mat because it was tired.", "layer": 3, "head": 0},
)
