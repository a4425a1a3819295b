"""explain_scaling's pass: one :class:`ScalingConsumer` over the layer, then the report built from its sums.

The pass is declared as a :class:`PassPlan` so the ``analyze`` job can stream it together with other tools'
consumers from one forward pass; run alone, the tool hands the same plan to ``inspector.execute``.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from torch import Tensor

from agent_tools.analysis.scaling import synthetic_scaling_demo
from agent_tools.consumers.scaling import ScalingConsumer, SettingSums
from agent_tools.families import StackFacts
from agent_tools.inspector import Inspector, PassPlan
from agent_tools.stack_input import on_stack
from agent_tools.tools.explain_scaling import narrative
from agent_tools.tools.explain_scaling.models import (
    DEFAULT_TEMPERATURES,
    ExplainScalingInput,
    HeadScoreVariance,
    ScaleSetting,
    ScalingReport,
    SyntheticRow,
)
from agent_tools.tools.explain_scaling.narrative import ScalingNumbers
from agent_tools.wording import is_standard_scale


def plan_explain_scaling(inspector: Inspector, args: ExplainScalingInput) -> PassPlan[ScalingReport]:
    """Explain the score scale of one layer: variance of q·k and of the scaled scores against the variance
    predicted from q and k, and what the softmax looks like (entropy, saturation, Jacobian) at the model's
    scale, with no scaling and over a temperature sweep. One forward pass over the layer (a
    :class:`ScalingConsumer`; rows are streamed) and the report built from its sums."""
    loaded = inspector.model(args.model)
    facts = loaded.facts
    stack = inspector.attention_stack(loaded, args.attention)
    layer = inspector.check_layer(loaded, args.layer, stack)
    every_head = list(range(stack.num_heads))
    heads = [inspector.check_head(loaded, args.head, stack)] if args.head is not None else every_head
    temperatures = list(args.temperatures) if args.temperatures is not None else list(DEFAULT_TEMPERATURES)
    encoded = inspector.encode_on(loaded, args.text, stack)
    inspector.require_two_keys(encoded, stack, "the scale sweep needs at least 2 tokens so a query sees 2 keys")
    consumer = ScalingConsumer(
        layer, heads, temperatures, model_scale=stack.scaling, query_prescaled=facts.query_prescaled
    )

    def finish(_output: object) -> ScalingReport:
        """The report from the consumer's sums (and the synthetic demonstration when asked for), then its words."""
        variances = consumer.variances()
        raw, scaled, predicted = (
            float(variances[name].mean()) for name in ("raw_variance", "scaled_variance", "predicted_isotropic")
        )
        ratio = stack.scaling * math.sqrt(stack.qk_dim)
        report = ScalingReport(
            model=loaded.name,
            summary="",
            findings=[],
            attention=stack.name,
            layer=layer,
            head=args.head,
            heads=heads,
            num_tokens=len(encoded.query_tokens),
            head_dim=stack.qk_dim,
            scaling=stack.scaling,
            inverse_sqrt_head_dim=1 / math.sqrt(stack.qk_dim),
            scaling_ratio=ratio,
            standard_scale=is_standard_scale(ratio),
            softcap=facts.softcap,
            query_prescaled=facts.query_prescaled,
            raw_score_variance=raw,
            scaled_score_variance=scaled,
            predicted_variance=predicted,
            variance_ratio=raw / predicted if predicted > 0 else math.inf,  # infinite when nothing is predicted
            head_variances=_head_rows(variances, heads, stack),
            settings=sorted((_setting(s) for s in consumer.settings), key=lambda s: s.beta),
            entropy_monotone=consumer.monotone_violations == 0,
            monotonicity_violations=consumer.monotone_violations,
            rows_checked=consumer.monotone_rows,
            synthetic=[SyntheticRow.model_validate(asdict(d)) for d in synthetic_scaling_demo()]
            if args.synthetic
            else [],
        )
        n = ScalingNumbers(report, stack.scaling, raw, scaled, predicted)
        words = {"summary": on_stack(stack.name, narrative.summary(n)), "findings": narrative.findings(n)}
        return report.model_copy(update=words)

    return PassPlan(loaded, encoded, [consumer], finish, layers=[layer])


def _head_rows(variances: dict[str, Tensor], heads: list[int], stack: StackFacts) -> list[HeadScoreVariance]:
    """Per head: measured Var(q·k) and Var(scaled), the two predictions and the q/k moments, rounded.

    ``variances``: :meth:`ScalingConsumer.variances`, each entry (heads,) in the order of ``heads``; its names are
    the row's fields (``pairs`` is not stated).
    """
    rows = []
    for i, head in enumerate(heads):
        row = {name: float(values[i]) for name, values in variances.items()}
        raw, iso, ind = row["raw_variance"], row["predicted_isotropic"], row["predicted_independent"]
        ratios = {
            "ratio_isotropic": raw / iso if iso > 0 else math.inf,
            "ratio_independent": raw / ind if ind > 0 else math.inf,
        }
        rows.append(HeadScoreVariance.model_validate(row | ratios | {"head": head, "kv_head": stack.kv_head_of(head)}))
    return rows


def _setting(setting: SettingSums) -> ScaleSetting:
    """One scale setting's pooled row means; dH/dβ only where the closed form applies (not for raw q·k)."""
    derivative = setting.derivative / setting.rows if setting.kind != "no_scaling" and setting.rows else None
    return ScaleSetting(
        kind=setting.kind,
        temperature=setting.temperature,
        beta=setting.beta,
        entropy_derivative=derivative,
        **setting.means(),
    )
