"""scaling_experiment's runs: four trainings of a tiny retrieval head (small/large d_k, with/without 1/sqrt(d_k)).

No pretrained model and no forward pass to share, so there is no :class:`PassPlan`: the "pass" is
:func:`agent_tools.analysis.scaling.train_retrieval`, called once per run, and the report is built from its curves.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict

from agent_tools.analysis.scaling import ExperimentRun, train_retrieval
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.session import call_checkpoint
from agent_tools.tools.scaling_experiment import narrative
from agent_tools.tools.scaling_experiment.models import (
    CURVE_POINTS,
    VANISHED,
    ExperimentCurve,
    ScalingExperimentInput,
    ScalingExperimentReport,
)

D_MODEL = 32  # width of the items and the query
LABELS = 16  # classes an item can carry
GAIN = 8.0  # logits = GAIN · Σ_j α_j onehot(label_j): the answer's logit when all weight is on one item


def _curve(run: ExperimentRun) -> ExperimentCurve:
    """One run's logged curves as the report states them (from the :class:`ExperimentRun` fields), with its
    start, end and gradient summary."""
    tail = max(1, len(run.loss) // 5)
    return ExperimentCurve.model_validate(
        asdict(run)
        | {
            "initial_entropy": run.attention_entropy[0],
            "initial_saturated_fraction": run.saturated_fraction[0],
            "initial_grad_norm_q": run.grad_norm_q[0],
            "final_loss": statistics.fmean(run.loss[-tail:]),
            "final_accuracy": statistics.fmean(run.accuracy[-tail:]),
            "vanished_gradient_fraction": sum(g < VANISHED for g in run.grad_norm_q) / len(run.grad_norm_q),
            "median_grad_norm_q": statistics.median(run.grad_norm_q),
        }
    )


def _train_runs(args: ScalingExperimentInput) -> list[ExperimentRun]:
    """Small then large d_k, each with then without the scale; same seed, so same data and initialisation.

    Every step checks the call's cancel flag and deadline: a stopped call stops training at once (at its limits
    one call is minutes of CPU, which a deadline that only answered would leave running).
    """
    log_every = args.log_every or max(1, args.steps // CURVE_POINTS)
    checkpoint = call_checkpoint()
    return [
        train_retrieval(
            head_dim,
            scaled=scaled,
            steps=args.steps,
            batch=args.batch,
            items=args.items,
            d_model=D_MODEL,
            labels=LABELS,
            gain=GAIN,
            learning_rate=args.learning_rate,
            log_every=log_every,
            seed=args.seed,
            checkpoint=checkpoint,
        )
        for head_dim in (args.small_head_dim, args.large_head_dim)
        for scaled in (True, False)
    ]


def scaling_experiment(inspector: Inspector, args: ScalingExperimentInput) -> ScalingExperimentReport:
    """Train a one-head attention model on a synthetic retrieval task, with and without the 1/sqrt(d_k) factor,
    at a small and a large d_k; return loss curves, W_q/W_k gradient norms and attention entropy over steps.

    CPU, seconds; deterministic for a seed. No pretrained model is involved.
    """
    if args.small_head_dim >= args.large_head_dim:
        msg = f"small_head_dim {args.small_head_dim} must be below large_head_dim {args.large_head_dim}"
        raise InvalidInputError(msg, field="small_head_dim")
    report = ScalingExperimentReport(
        model="synthetic single-head retrieval model (no pretrained model)",
        summary="",
        findings=[],
        task=narrative.task(D_MODEL, LABELS, GAIN),
        d_model=D_MODEL,
        items=args.items,
        labels=LABELS,
        batch=args.batch,
        steps=args.steps,
        learning_rate=args.learning_rate,
        seed=args.seed,
        max_entropy=math.log(args.items),
        chance_loss=math.log(LABELS),
        answer_gain=GAIN,
        confident_wrong_loss=math.log(math.exp(GAIN) + LABELS - 1),
        runs=[_curve(run) for run in _train_runs(args)],
    )
    return report.model_copy(update={"summary": narrative.summary(report), "findings": narrative.findings(report)})
