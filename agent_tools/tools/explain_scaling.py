"""explain_scaling: what does 1/sqrt(d_k) do in this model, on this text?"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, Field
from pydantic_core import PydanticCustomError

from agent_tools.analysis.scaling import (
    SATURATION,
    SYNTHETIC_HEAD_DIMS,
    ScalingConsumer,
    SettingKind,
    SyntheticScaling,
    synthetic_scaling_demo,
)
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector, PassPlan
from agent_tools.loading import LoadedModel
from agent_tools.schemas import Finding, Report, TextInput, rounded
from agent_tools.tools.registry import ToolSpec

DEFAULT_TEMPERATURES = (0.25, 0.5, 2.0, 4.0)
NULL_TEMPERATURE = "Input should be a finite number > 0 (NaN and ±infinity have no JSON form: they arrive as null)"


def _not_null(value: object) -> object:
    """JSON writes NaN and ±infinity as null: say what is valid instead of "a valid number (got None)"."""
    if value is None:
        raise PydanticCustomError("finite_number", NULL_TEMPERATURE)
    return value


Temperature = Annotated[float, Field(gt=0.0, allow_inf_nan=False), BeforeValidator(_not_null)]


class ExplainScalingInput(TextInput):
    layer: int = Field(description="layer index, 0-based (describe_model gives the range)")
    head: int | None = Field(default=None, description="one query head; omitted = every head of the layer")
    temperatures: list[Temperature] | None = Field(
        default=None,
        min_length=1,
        max_length=16,
        description=(
            "temperatures τ > 0 (finite) dividing the model's own logits; τ = 1 is the model and is always "
            f"included; omitted = {list(DEFAULT_TEMPERATURES)}"
        ),
    )
    synthetic: bool = Field(
        default=True, description=f"add the model-free demonstration with random q, k for d_k in {SYNTHETIC_HEAD_DIMS}"
    )


class SoftmaxSummary(BaseModel):
    entropy: float = Field(description="mean row entropy, nats")
    normalised_entropy: float = Field(description="mean entropy / log(visible keys): 0 one key, 1 uniform")
    mean_max_weight: float
    saturated_fraction: float = Field(description=f"fraction of rows with max weight ≥ {SATURATION}")
    jacobian_trace: float = Field(description="mean trace of the softmax Jacobian diag(p) − ppᵀ = 1 − Σp²")
    jacobian_frobenius: float = Field(description="mean ‖diag(p) − ppᵀ‖_F: how much gradient the softmax passes back")


class ScaleSetting(SoftmaxSummary):
    kind: SettingKind
    temperature: float | None = Field(description="τ dividing the model's logits (None for no scaling)")
    beta: float = Field(description="the factor multiplying raw q·k (model scale / τ, or 1 with no scaling)")
    entropy_derivative: float | None = Field(
        description="mean dH/dβ for logits β·z_model at this β, closed form −β·Var_p(z) (≤ 0)"
    )


class HeadScoreVariance(BaseModel):
    head: int
    kv_head: int
    raw_variance: float = Field(description="measured Var(q·k) over the (query, visible key) pairs")
    scaled_variance: float = Field(description="measured Var(q·k · scale)")
    predicted_isotropic: float = Field(description="mean_d Var(q_d) · mean_d Var(k_d) · d_k (textbook)")
    predicted_independent: float = Field(
        description="Σ_d Var(q_d)Var(k_d) + Var(q_d)E[k_d]² + E[q_d]²Var(k_d): independent components, means kept"
    )
    ratio_isotropic: float = Field(description="measured / predicted_isotropic")
    ratio_independent: float = Field(description="measured / predicted_independent")
    q_variance: float = Field(description="mean per-component variance of q over tokens")
    k_variance: float = Field(description="mean per-component variance of k over tokens")
    q_mean_square: float = Field(description="mean squared per-component mean of q (non-zero means break isotropy)")
    k_mean_square: float


class SyntheticRow(BaseModel):
    head_dim: int
    dot_variance: float = Field(description="Var(q·k) for unit-variance random q, k: ≈ d_k")
    scaled_variance: float = Field(description="Var(q·k / sqrt(d_k)): ≈ 1")
    unscaled: SoftmaxSummary
    scaled: SoftmaxSummary


class ScalingReport(Report):
    layer: int
    head: int | None
    heads: list[int]
    num_tokens: int
    head_dim: int = Field(description="d_k")
    scaling: float = Field(description="the factor the model multiplies q·k by")
    inverse_sqrt_head_dim: float
    scaling_ratio: float = Field(description="scaling · sqrt(d_k): 1 = the standard 1/sqrt(d_k)")
    standard_scale: bool
    softcap: float | None
    query_prescaled: bool
    raw_score_variance: float = Field(description="measured Var(q·k), mean over the heads")
    scaled_score_variance: float = Field(description="measured Var of the scaled scores, mean over the heads")
    predicted_variance: float = Field(
        description="var(q)·var(k)·d_k from measured component variances, mean over heads"
    )
    variance_ratio: float = Field(description="raw_score_variance / predicted_variance")
    head_variances: list[HeadScoreVariance]
    settings: list[ScaleSetting] = Field(description="model scale, no scaling and the temperature sweep (pooled rows)")
    entropy_monotone: bool = Field(description="every row's entropy is non-increasing as β grows along the sweep")
    monotonicity_violations: int
    rows_checked: int
    synthetic: list[SyntheticRow]


def _summary_of(means: dict[str, float]) -> SoftmaxSummary:
    return SoftmaxSummary(**{name: rounded(value) for name, value in means.items()})


def _synthetic_row(demo: SyntheticScaling) -> SyntheticRow:
    return SyntheticRow(
        head_dim=demo.head_dim,
        dot_variance=rounded(demo.dot_variance),
        scaled_variance=rounded(demo.scaled_variance),
        unscaled=_summary_of(demo.unscaled),
        scaled=_summary_of(demo.scaled),
    )


def explain_scaling(inspector: Inspector, args: ExplainScalingInput) -> ScalingReport:
    """Explain the score scale of one layer: variance of q·k and of the scaled scores against the variance
    predicted from q and k, and what the softmax looks like (entropy, saturation, Jacobian) at the model's
    scale, with no scaling and over a temperature sweep. One forward pass; rows are streamed."""
    return inspector.execute(plan_explain_scaling(inspector, args))


def plan_explain_scaling(inspector: Inspector, args: ExplainScalingInput) -> PassPlan[ScalingReport]:
    """The pass over the layer (a :class:`ScalingConsumer`) and the report built from it."""
    loaded = inspector.model(args.model)
    facts = loaded.facts
    layer = inspector.check_layer(loaded, args.layer)
    heads = [inspector.check_head(loaded, args.head)] if args.head is not None else list(range(facts.num_heads))
    temperatures = list(args.temperatures) if args.temperatures is not None else list(DEFAULT_TEMPERATURES)
    encoded = inspector.encode(loaded, args.text)
    if facts.is_causal and encoded.length < 2:
        msg = f"text is {encoded.length} token; the scale sweep needs at least 2 tokens so a query sees 2 keys"
        raise InvalidInputError(msg, field="text")
    consumer = ScalingConsumer(
        layer, heads, temperatures, model_scale=facts.scaling, query_prescaled=facts.query_prescaled
    )

    def finish(_output: object) -> ScalingReport:
        return _report(args, loaded, layer, heads, consumer, encoded.length)

    return PassPlan(loaded, encoded, [consumer], finish, layers=[layer])


def _report(
    args: ExplainScalingInput,
    loaded: LoadedModel,
    layer: int,
    heads: list[int],
    consumer: ScalingConsumer,
    num_tokens: int,
) -> ScalingReport:
    facts = loaded.facts
    variances = consumer.variances()

    head_rows = []
    for i, head in enumerate(heads):
        raw = float(variances["raw_variance"][i])
        iso = float(variances["predicted_isotropic"][i])
        ind = float(variances["predicted_independent"][i])
        head_rows.append(
            HeadScoreVariance(
                head=head,
                kv_head=facts.kv_head_of(head),
                raw_variance=rounded(raw),
                scaled_variance=rounded(float(variances["scaled_variance"][i])),
                predicted_isotropic=rounded(iso),
                predicted_independent=rounded(ind),
                ratio_isotropic=rounded(raw / iso if iso > 0 else math.inf),
                ratio_independent=rounded(raw / ind if ind > 0 else math.inf),
                q_variance=rounded(float(variances["q_variance"][i])),
                k_variance=rounded(float(variances["k_variance"][i])),
                q_mean_square=rounded(float(variances["q_mean_square"][i])),
                k_mean_square=rounded(float(variances["k_mean_square"][i])),
            )
        )
    settings = []
    for setting in consumer.settings:
        means = setting.means()
        derivative = setting.derivative / setting.rows if setting.kind != "no_scaling" and setting.rows else None
        settings.append(
            ScaleSetting(
                kind=setting.kind,
                temperature=setting.temperature,
                beta=rounded(setting.beta, 6),
                entropy_derivative=None if derivative is None else rounded(derivative),
                **{name: rounded(value) for name, value in means.items()},
            )
        )
    settings.sort(key=lambda s: s.beta)
    synthetic = [_synthetic_row(d) for d in synthetic_scaling_demo()] if args.synthetic else []

    raw_mean = float(variances["raw_variance"].mean())
    scaled_mean = float(variances["scaled_variance"].mean())
    predicted = float(variances["predicted_isotropic"].mean())
    ratio = facts.scaling * math.sqrt(facts.head_dim)
    model_setting = next(s for s in settings if s.kind == "model_scale")
    unscaled = next(s for s in settings if s.kind == "no_scaling")
    where = f"layer {layer}" + (f" head {args.head}" if args.head is not None else f" ({len(heads)} heads)")
    findings = _findings(
        layer, args.head, facts.head_dim, facts.scaling, ratio, raw_mean, scaled_mean, predicted, head_rows,
        model_setting, unscaled, consumer, synthetic,
    )  # fmt: skip
    summary = (
        f"In {where}, d_k = {facts.head_dim} and scores are q·k × {facts.scaling:.4g} "
        f"({'= 1/sqrt(d_k)' if abs(ratio - 1) <= 1e-3 else f'{ratio:.3g}× 1/sqrt(d_k)'}). Raw q·k has variance "
        f"{raw_mean:.3g} (var(q)·var(k)·d_k predicts {predicted:.3g}, ratio {raw_mean / predicted:.2f}); scaled scores "
        f"{scaled_mean:.3g}. Without the scale, rows saturate ({unscaled.saturated_fraction:.0%} with max ≥ "
        f"{SATURATION} vs {model_setting.saturated_fraction:.0%}), entropy falls from {model_setting.entropy:.3f} to "
        f"{unscaled.entropy:.3f} nats and the gradient the softmax passes back shrinks: Jacobian trace 1 − Σp² "
        f"{model_setting.jacobian_trace:.3f} → {unscaled.jacobian_trace:.3f}, ‖J‖_F "
        f"{model_setting.jacobian_frobenius:.3f} → {unscaled.jacobian_frobenius:.3f}."
    )
    return ScalingReport(
        model=loaded.name,
        summary=summary,
        findings=findings,
        layer=layer,
        head=args.head,
        heads=heads,
        num_tokens=num_tokens,
        head_dim=facts.head_dim,
        scaling=rounded(facts.scaling, 6),
        inverse_sqrt_head_dim=rounded(1 / math.sqrt(facts.head_dim), 6),
        scaling_ratio=rounded(ratio),
        standard_scale=abs(ratio - 1) <= 1e-3,
        softcap=facts.softcap,
        query_prescaled=facts.query_prescaled,
        raw_score_variance=rounded(raw_mean),
        scaled_score_variance=rounded(scaled_mean),
        predicted_variance=rounded(predicted),
        variance_ratio=rounded(raw_mean / predicted if predicted > 0 else math.inf),
        head_variances=head_rows,
        settings=settings,
        entropy_monotone=consumer.monotone_violations == 0,
        monotonicity_violations=consumer.monotone_violations,
        rows_checked=consumer.monotone_rows,
        synthetic=synthetic,
    )


def _findings(
    layer: int,
    head: int | None,
    head_dim: int,
    scaling: float,
    ratio: float,
    raw_mean: float,
    scaled_mean: float,
    predicted: float,
    head_rows: list[HeadScoreVariance],
    model_setting: ScaleSetting,
    unscaled: ScaleSetting,
    consumer: ScalingConsumer,
    synthetic: list[SyntheticRow],
) -> list[Finding]:
    findings = [
        Finding(
            kind="scale",
            layer=layer,
            head=head,
            value=rounded(ratio),
            detail=(
                f"the model multiplies q·k by {scaling:.4g}; 1/sqrt({head_dim}) = {1 / math.sqrt(head_dim):.4g} "
                f"(ratio {ratio:.3g})"
            ),
        ),
        Finding(
            kind="score_variance",
            layer=layer,
            head=head,
            value=rounded(raw_mean / predicted if predicted > 0 else math.inf),
            detail=(
                f"Var(q·k) = {raw_mean:.3g} measured vs {predicted:.3g} predicted by var(q)·var(k)·d_k; "
                f"after scaling {scaled_mean:.3g} (= {raw_mean:.3g} × {scaling:.4g}²)"
            ),
        ),
    ]
    if len(head_rows) > 1:
        wide = max(head_rows, key=lambda r: r.raw_variance)
        findings.append(
            Finding(
                kind="widest_head",
                layer=layer,
                head=wide.head,
                value=wide.raw_variance,
                detail=(
                    f"L{layer}H{wide.head} has the widest scores: Var(q·k) = {wide.raw_variance:.3g} "
                    f"({wide.ratio_isotropic:.2f}× the isotropic prediction, {wide.ratio_independent:.2f}× the "
                    "prediction with component means)"
                ),
            )
        )
    findings.append(
        Finding(
            kind="no_scaling",
            layer=layer,
            head=head,
            value=unscaled.saturated_fraction,
            detail=(
                f"without 1/sqrt(d_k): {unscaled.saturated_fraction:.0%} of rows saturated (model: "
                f"{model_setting.saturated_fraction:.0%}), mean max weight {unscaled.mean_max_weight:.3f} "
                f"(model {model_setting.mean_max_weight:.3f}), Jacobian trace {unscaled.jacobian_trace:.3f} "
                f"(model {model_setting.jacobian_trace:.3f})"
            ),
        )
    )
    findings.append(
        Finding(
            kind="entropy_monotone",
            layer=layer,
            head=head,
            value=float(consumer.monotone_violations),
            detail=(
                f"dH/dβ = −β·Var_p(z) ≤ 0: entropy never rose with the scale on {consumer.monotone_rows} rows "
                f"({consumer.monotone_violations} violations); dH/dβ at the model's scale averages "
                f"{model_setting.entropy_derivative}"
            ),
        )
    )
    if synthetic:
        small, large = synthetic[0], synthetic[-1]
        findings.append(
            Finding(
                kind="synthetic",
                value=large.dot_variance,
                detail=(
                    f"random unit-variance q, k: Var(q·k) = {small.dot_variance:.3g} at d_k={small.head_dim} and "
                    f"{large.dot_variance:.4g} at d_k={large.head_dim}; unscaled at d_k={large.head_dim} "
                    f"{large.unscaled.saturated_fraction:.0%} of rows saturate and the Jacobian trace is "
                    f"{large.unscaled.jacobian_trace:.3g}, scaled {large.scaled.saturated_fraction:.0%} and "
                    f"{large.scaled.jacobian_trace:.3g}"
                ),
            )
        )
    return findings


SPEC = ToolSpec(
    name="explain_scaling",
    description=(
        "Explain what the 1/sqrt(d_k) score scale does in one layer (or head) on a text: d_k and the model's "
        "actual scale, the measured variance of raw q·k and of the scaled scores next to var(q)·var(k)·d_k, and "
        "for the model's scale, no scaling and a temperature sweep: entropy, mean max weight, fraction of "
        "saturated rows and the softmax Jacobian's trace and norm (how much gradient flows back). Checks that "
        "entropy never rises as the scale grows, and adds a model-free demonstration for d_k = 16..1024."
    ),
    input_model=ExplainScalingInput,
    output_model=ScalingReport,
    run=explain_scaling,
    plan=plan_explain_scaling,
    example={"text": "The cat sat on the mat because it was tired.", "layer": 3},
)
