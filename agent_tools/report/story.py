"""The report's story, in the order of the essay the project started from: each step a question, two or three
plain sentences written from *this model's* measured numbers, and the pictures that show it.

1. the raw dot product x·xᵀ (each token mostly finds itself);
2. the scale: Var(q·k) grows with d_k, and what the softmax does across scales (the model's marked);
3. the projections added one by one (the reconstruction's stages) and the ingredient that changes the map most;
4. Q = K = V = x next to the real head ("what I look for" vs "what I offer");
5. collapse: what removing each collapsed head does against random heads (kinds), then the value-norm evidence
   labelled as such, sinks as no-ops;
6. what each head does, the induction head shown on the probe where its behaviour is visible;
7. the training experiment: loss, accuracy and ‖∂L/∂W_q‖ with and without the scale;
8. for a long text, the long-context section: retrieval heads, the short-cache plan and the U-curve
   (:mod:`agent_tools.report.long_context`).

Pure functions of an :class:`~agent_tools.report.job.AnalysisResult`'s reports and views; a step whose tool did
not run is left out. The pictures are named here and drawn once by :mod:`agent_tools.report.figures`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from agent_tools.analysis.collapse import NO_OP_CONTRIBUTION
from agent_tools.analysis.metrics import SATURATION
from agent_tools.report.long_context import LONG_CONTEXT_QUESTION, long_context_sentences
from agent_tools.report.views import ProbeView
from agent_tools.tools.diagnose_collapse.models import CollapseCheck, CollapseReport, HeadCollapseRow
from agent_tools.tools.diagnose_collapse.narrative import check_sentence, ordered_checks, together_sentence
from agent_tools.tools.explain_scaling.models import ScalingReport
from agent_tools.tools.find_retrieval_heads.models import FindRetrievalHeadsReport
from agent_tools.tools.inspect_projections.models import ProjectionReport
from agent_tools.tools.plan_kv_cache.models import PlanKvCacheReport
from agent_tools.tools.position_sensitivity.models import PositionSensitivityReport
from agent_tools.tools.profile_heads.models import HeadProfiles
from agent_tools.tools.reconstruct_attention.models import AttentionReconstruction
from agent_tools.tools.reconstruct_attention.narrative import decisive_stage
from agent_tools.tools.scaling_experiment.models import VANISHED, ScalingExperimentReport
from agent_tools.wording import head_name, head_names, signed

if TYPE_CHECKING:
    from agent_tools.report.job import AnalysisResult

STAGE_INGREDIENTS = {
    "raw_dot_product": "the raw dot product",
    "scaled_dot_product": "the 1/sqrt(d_k) scale",
    "projected": "the projections W_Q and W_K",
    "positional": "the positions (RoPE)",
    "model": "the mask, soft-capping and softmax",
}
STAGE_SHORT = {
    "raw_dot_product": "raw x·xᵀ",
    "scaled_dot_product": "÷ sqrt(d_k)",
    "projected": "x W_Q · (x W_K)ᵀ",
    "positional": "+ positions",
    "model": "the model",
}


@dataclass(frozen=True)
class StoryPicture:
    """A picture of a step: its file stem (``<name>.png``) and its caption."""

    name: str
    caption: str


@dataclass(frozen=True)
class StoryStep:
    """One step: the reader's question, the sentences answering it, the pictures showing it."""

    key: str
    number: int
    title: str
    question: str
    sentences: list[str]
    pictures: list[StoryPicture] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)  # pictures as {name, caption}


def _num(value: float) -> str:
    """A measured number for reading: three significant digits, thousands separated (1,540 not 1.54e+03)."""
    if abs(value) >= 1000:
        return f"{float(f'{value:.3g}'):,.0f}"
    return f"{value:.3g}"


# --- 1. the raw dot product ---------------------------------------------------------------------------------


def raw_step(result: AnalysisResult) -> StoryStep | None:
    """softmax(x·xᵀ): how often a token's largest weight is on itself."""
    rebuilt = result.report("reconstruct_attention", AttentionReconstruction)
    if rebuilt is None:
        return None
    first = rebuilt.stages[0]
    choosing = [row for row in first.top_keys if row.position > 0 or not first.masked]
    on_self = sum(row.key_position == row.position for row in choosing) / max(1, len(choosing))
    where = f"layer {rebuilt.layer}'s input x ({rebuilt.hidden_size} numbers per token)"
    return StoryStep(
        key="raw",
        number=1,
        title="The raw dot product x·xᵀ",
        question="What does the plainest attention, softmax(x·xᵀ) with no scale and no projections, do?",
        sentences=[
            f"Scoring every pair of tokens by the dot product of {where}, {on_self:.0%} of the queries give "
            f"their largest weight to themselves (mean self-share {first.self_share:.2f}).",
            "A vector's dot product with itself, ‖x_i‖², is usually the largest it has with anything, so a raw "
            "lookup mostly finds the token that asked.",
            f"The rows are also very sharp — mean entropy {first.mean_entropy:.3f} nats — because raw scores "
            f"spread widely (standard deviation {first.logit_std:.3g} per query): nothing has told the model to "
            "look anywhere else yet.",
        ],
        pictures=[StoryPicture("story-1-raw-dot", f"softmax(x·xᵀ) for the first tokens ({_window(result)})")],
    )


def _window(result: AnalysisResult) -> str:
    views = result.stages
    if views is None:
        return "layer input"
    shown = len(views.labels)
    rebuilt = result.report("reconstruct_attention", AttentionReconstruction)
    mask = rebuilt.mask if rebuilt is not None else ""
    masked = f"; the {mask} mask applied" if views.masked_every_stage and mask and not mask.startswith("none") else ""
    return f"{shown} of {views.length} tokens{masked}"


# --- 2. the scale -------------------------------------------------------------------------------------------


def scale_step(result: AnalysisResult) -> StoryStep | None:
    """Var(q·k) against d_k, and the softmax across scales with the model's marked."""
    scaling = result.report("explain_scaling", ScalingReport)
    if scaling is None:
        return None
    model = next(s for s in scaling.settings if s.kind == "model_scale")
    raw = next(s for s in scaling.settings if s.kind == "no_scaling")
    synthetic = scaling.synthetic
    grows = (
        f"; for random unit-variance q and k it grows with d_k ({_num(synthetic[0].dot_variance)} at d_k = "
        f"{synthetic[0].head_dim}, {_num(synthetic[-1].dot_variance)} at d_k = {synthetic[-1].head_dim})"
        if synthetic
        else ""
    )
    return StoryStep(
        key="scale",
        number=2,
        title="The scale 1/sqrt(d_k)",
        question="Why divide the scores by sqrt(d_k) — what would this model's softmax do without it?",
        sentences=[
            f"In layer {scaling.layer} (d_k = {scaling.head_dim}), q·k has variance {_num(scaling.raw_score_variance)} "
            f"across its heads' (query, key) pairs{grows}. The model multiplies by {scaling.scaling:.4g} "
            f"(÷ {1 / scaling.scaling:.3g}), which brings the variance down to {_num(scaling.scaled_score_variance)}.",
            f"Without the scale {raw.saturated_fraction:.0%} of the rows would be saturated (max weight ≥ "
            f"{SATURATION}; the model: {model.saturated_fraction:.0%}), entropy would fall from {model.entropy:.3f} "
            f"to {raw.entropy:.3f} nats, and the softmax Jacobian trace — how much gradient flows back through the "
            f"softmax — from {model.jacobian_trace:.3f} to {raw.jacobian_trace:.3f}.",
            f"Across the temperature sweep entropy only falls as the scale grows (dH/dβ ≤ 0; "
            f"{scaling.monotonicity_violations} of {scaling.rows_checked} rows broke the rule).",
        ],
        pictures=[
            StoryPicture("story-2-variance", "Var(q·k) against d_k: random vectors, and this layer's heads"),
            StoryPicture("story-2-entropy", "entropy across scales β (the model's scale marked)"),
            StoryPicture("story-2-saturation", "saturated rows across scales β"),
            StoryPicture("story-2-jacobian", "softmax Jacobian trace across scales β: the gradient that flows back"),
        ],
    )


# --- 3. the projections, one by one -------------------------------------------------------------------------


def stages_step(result: AnalysisResult) -> StoryStep | None:
    """The reconstruction's stages side by side and the ingredient that changes the map most."""
    rebuilt = result.report("reconstruct_attention", AttentionReconstruction)
    if rebuilt is None:
        return None
    stages = rebuilt.stages
    index, _drop = decisive_stage(stages)
    before, after = stages[index - 1], stages[index]
    entropies = " → ".join(f"{STAGE_SHORT[s.name]} {s.mean_entropy:.2f}" for s in stages)
    return StoryStep(
        key="stages",
        number=3,
        title="Adding the pieces one by one",
        question=f"Which ingredient makes {head_name(rebuilt.layer, rebuilt.head)} attend the way it does?",
        sentences=[
            f"Rebuilding {head_name(rebuilt.layer, rebuilt.head)} (the most collapsed head) from its input, the mean "
            f"entropy per stage in nats is {entropies}; stage 5 equals the model's own map (error "
            f"{rebuilt.model_weight_error:.1e}).",
            f"The ingredient that changes the map most is {STAGE_INGREDIENTS[after.name]} (stage {after.stage}): "
            f"the JS divergence to the model's map falls from {before.masked_js_to_model:.3f} to "
            f"{after.masked_js_to_model:.3f} nats, and the top key agrees with the model's for "
            f"{after.top_key_agreement:.0%} of the queries instead of {before.top_key_agreement:.0%}.",
            f"Each stage divides the dot products by: {_divisors(stages)}.",
        ],
        pictures=[
            StoryPicture(f"story-3-stage-{s.stage}", f"stage {s.stage}: {STAGE_SHORT[s.name]} (÷ {s.divisor:.3g})")
            for s in stages
        ],
    )


def _divisors(stages: list[Any]) -> str:
    return ", ".join(f"stage {s.stage} ÷ {s.divisor:.3g}" for s in stages)


# --- 4. Q = K = V = x ---------------------------------------------------------------------------------------


def no_projection_step(result: AnalysisResult) -> StoryStep | None:
    """The counterfactual with no projections next to the real head, and the W_Q/W_K subspaces."""
    projections = result.report("inspect_projections", ProjectionReport)
    if projections is None:
        return None
    cf, angles = projections.counterfactual, projections.query_key_angles
    where = head_name(projections.layer, projections.head)
    return StoryStep(
        key="no_projections",
        number=4,
        title="Q = K = V = x: attention without W_q, W_k, W_v",
        question="Why does a head need three projections of the same input?",
        sentences=[
            f"With the raw input as query, key and value (same scale and mask), {cf.self_argmax_fraction:.0%} of "
            f"the queries would attend mostly to themselves; the real {where} does so for "
            f"{cf.model_self_argmax_fraction:.0%}, and the two maps differ by a mean JS divergence of "
            f"{cf.mean_js_divergence:.3f} nats (of at most ln 2 = 0.693).",
            f"W_Q and W_K read different directions of x: the mean cos² of their principal angles is "
            f"{angles.mean_cos2:.3f}, close to {angles.random_mean_cos2:.3f} for random subspaces (1 would be the "
            "same subspace) — 'what I am looking for' and 'what I have to offer' are different questions, which "
            "one shared vector cannot ask.",
        ],
        pictures=[StoryPicture("story-4-no-projections", f"Q = K = V = x (left) and the real {where} (right)")],
    )


# --- 5. collapse ------------------------------------------------------------------------------------------


def _writing_sentence(row: HeadCollapseRow) -> str:
    values = ""
    if row.dominant_contribution is not None and row.other_value_norm is not None:
        values = (
            f" — it writes ‖α·v W_O‖ = {row.dominant_contribution:.3g} against {row.other_value_norm:.3g} for an "
            f"ordinary key's ‖v W_O‖ (contribution ratio {row.contribution_ratio:.2f} ≥ {NO_OP_CONTRIBUTION})"
        )
    return (
        f"{head_name(row.layer, row.head)} collapses onto {row.dominant_position}:{row.dominant_token!r} whatever the "
        f"query (mean max weight {row.mean_max_weight:.3f}){values}"
    )


def _check_sentences(check: CollapseCheck) -> list[str]:
    """What removing the collapsed heads did, in the tool's own words (the same sentences the agent reads)."""
    ordered = ordered_checks(check)
    named = "; ".join(check_sentence(r, check) for r in ordered[:3])
    more = ""
    if len(ordered) > 3:
        more = f" ({len(ordered) - 3} more checked: {', '.join(head_name(r.layer, r.head) for r in ordered[3:])})"
    harmful = [r for r in check.heads if r.kind == "harmful"]
    sentences = [
        f"Removing each collapsed head shows whether it matters ({check.checked} of {check.collapsed} checked, "
        f"mean- and resample-ablation, {check.rule}): {named}{more}."
    ]
    if check.together is not None:
        sentences.append(together_sentence(check))
    if not harmful and check.measure == "next_token_loss":
        sentences.append("None is harmful: no removal lowers the loss beyond what removing random heads does.")
    return sentences


def _other_verdicts(rows: list[HeadCollapseRow]) -> str:
    """The concentrated heads that are neither harmful nor sinks: positional and query-dependent ones."""
    positional = [r for r in rows if r.verdict == "positional"]
    dependent = [r for r in rows if r.verdict == "query_dependent"]
    parts = []
    if positional:
        names = ", ".join(head_name(r.layer, r.head) for r in positional[:4])
        parts.append(f"{len(positional)} positional ({names}: they read the previous token or themselves — a job)")
    if dependent:
        parts.append(f"{len(dependent)} sharp but query-dependent (the chosen key changes with the query)")
    return f"Not failures either: {' and '.join(parts)}." if parts else ""


def collapse_step(result: AnalysisResult) -> StoryStep | None:
    """What removing the collapsed heads did (kinds against random heads), then the value side: the heads that
    write substantially, each named, and the sinks, explained as no-ops."""
    collapse = result.report("diagnose_collapse", CollapseReport)
    if collapse is None:
        return None
    rows = result.collapse_rows or collapse.heads
    writing = [r for r in rows if r.verdict == "writing_collapse"]
    sinks = [r for r in rows if r.verdict == "no_op_sink"]
    many = collapse.concentrated_heads != 1
    sentences = [
        f"{collapse.concentrated_heads} of {collapse.heads_examined} heads put{'' if many else 's'} nearly all "
        f"{'their' if many else 'its'} weight on one key (the essay's '99% of the attention regardless of the "
        "context')."
    ]
    if collapse.check is not None:
        sentences += _check_sentences(collapse.check)
    else:
        sentences.append("Removing the heads was not measured, so nothing here says whether a collapse matters.")
    if writing:
        named = "; ".join(_writing_sentence(r) for r in writing[:3])
        more = f" ({len(writing) - 3} more: {', '.join(head_name(r.layer, r.head) for r in writing[3:])})"
        sentences.append(
            f"Value side (norms, not effects): {named}{more if len(writing) > 3 else ''}. Such a head writes about "
            "the same vector at every position."
        )
    if sinks:
        largest = max((r.contribution_ratio or 0.0) for r in sinks)
        who = f"The other {len(sinks)}" if writing else ("All" if len(sinks) > 1 else "It")
        are = "is a no-op sink: it parks its" if len(sinks) == 1 else "are no-op sinks: they park their"
        write = "it writes" if len(sinks) == 1 else "they write"
        sentences.append(
            f"{who} {are} weight on a token whose value is tiny (contribution ratio at most {largest:.2f} < "
            f"{NO_OP_CONTRIBUTION}), so {write} almost nothing — the model's way of saying 'nothing to add here', "
            "not a failure."
        )
    other = _other_verdicts(rows)
    if other:
        sentences.append(other)
    return StoryStep(
        key="collapse",
        number=5,
        title="Collapse: one token gets all the attention",
        question="Which heads collapse onto one token, and does it matter?",
        sentences=sentences,
        pictures=[StoryPicture("story-5-value-norms", "what the collapsed heads write: contribution ratio per head")],
    )


# --- 6. head roles ----------------------------------------------------------------------------------------


def _role_tops(profile: Any) -> str:
    """Each role's top qualifying head with its mean ± spread, and "is" only where its ablation check agreed."""
    tops = []
    for role in profile.roles:
        qualified = [t for t in role.top if t.qualifies]
        if qualified:
            top = qualified[0]
            spread = f" ± {top.spread:.2f}" if top.spread is not None else ""
            said = f"{role.role.replace('_', '-')} {head_name(top.layer, top.head)} ({top.score:.2f}{spread}"
            evidence = top.ablation
            if (
                top.verdict in ("is_role", "attends_only")
                and evidence is not None
                and evidence.baseline_mean is not None
            ):
                word = "confirmed" if top.verdict == "is_role" else "attends only"
                said += (
                    f"; {word}: mean-ablation {signed(evidence.value)} nats vs {evidence.baseline_draws} random heads "
                    f"{signed(evidence.baseline_mean)} ± {evidence.baseline_spread:.2f}"
                )
            tops.append(said + ")")
    return ", ".join(tops)


def _induction_sentence(result: AnalysisResult, probe: ProbeView) -> str:
    """The top induction head on its probe, and what it does on the text instead."""
    where = head_name(probe.layer, probe.head)
    setting = (
        f"Induction is measured on a probe of {probe.repeat_length} random tokens repeated once, where copying is "
        "the only way to predict the second copy"
    )
    if not probe.qualifies:
        return (
            f"{setting}: no head reaches the induction threshold of {probe.threshold:.2f}; the closest, {where}, "
            f"gives {probe.induction_share:.0%} of its weight to the token after the earlier occurrence."
        )
    text_share = float(result.maps.first_token_share[probe.layer, probe.head])
    return (
        f"{setting}: {where} gives {probe.induction_share:.0%} of its weight to the token after the earlier "
        f"occurrence (on this text, with little to copy, it puts {text_share:.0%} of its weight on the first token)."
    )


def roles_step(result: AnalysisResult) -> StoryStep | None:
    """The strongest head per role, and the induction head on its probe."""
    profile = result.report("profile_heads", HeadProfiles)
    if profile is None:
        return None
    sentences = [
        f"The strongest head per role (role score in [0, 1], mean ± spread over texts or probes): "
        f"{_role_tops(profile)}."
    ]
    pictures = [StoryPicture("grid-role", "primary role per head (letters) and its score (colour)")]
    probe, check = result.probe, profile.induction_check
    if probe is not None:
        sentences.append(_induction_sentence(result, probe))
        pictures.append(
            StoryPicture(
                "story-6-induction-probe", f"{head_name(probe.layer, probe.head)} on the probe (seed {probe.seed})"
            )
        )
    if check is not None:
        ablated = (
            f", and {check.loss_second_copy_ablated:.2f} with {head_names(check.ablated_heads)} mean-ablated"
            if check.loss_second_copy_ablated is not None
            else ""
        )
        if check.loss_second_copy_ablated is not None and check.baseline_mean is not None:
            ablated += (
                f" ({check.baseline_mean:.2f} ± {check.baseline_spread:.2f} with {check.baseline_draws} random sets "
                f"of as many heads{'' if check.exceeds_baseline else ': no more than chance'})"
            )
        sentences.append(
            f"The model's next-token loss falls from {check.loss_first_copy:.2f} nats on the first copy to "
            f"{check.loss_second_copy:.2f} on the second{ablated}."
        )
    return StoryStep(
        key="roles",
        number=6,
        title="What each head does",
        question="Which heads do recognisable jobs: previous token, induction (copying), sinks?",
        sentences=sentences,
        pictures=pictures,
    )


# --- 7. training with and without the scale -----------------------------------------------------------------


def training_step(result: AnalysisResult) -> StoryStep | None:
    """The four training runs: final losses, and why the unscaled ones end above chance."""
    experiment = result.report("scaling_experiment", ScalingExperimentReport)
    if experiment is None:
        return None
    runs = {(c.head_dim, c.scaled): c for c in experiment.runs}
    small, large = min(d for d, _ in runs), max(d for d, _ in runs)
    raw_large, raw_small = runs[(large, False)], runs[(small, False)]
    wrong = 1 - raw_large.final_accuracy
    return StoryStep(
        key="training",
        number=7,
        title="Training with and without the scale",
        question="Does a model 'refuse to converge' without 1/sqrt(d_k)?",
        sentences=[
            f"A one-head model learns to retrieve 1 of {experiment.items} items ({experiment.steps} SGD steps): with "
            f"the scale its loss ends at {runs[(small, True)].final_loss:.3f} (d_k = {small}) and "
            f"{runs[(large, True)].final_loss:.3f} (d_k = {large}); without it at {raw_small.final_loss:.2f} and "
            f"{raw_large.final_loss:.2f} — above the chance loss ln {experiment.labels} = {experiment.chance_loss:.2f} "
            "of a uniform guess.",
            f"Why above chance: unscaled, the attention starts saturated ({raw_large.initial_saturated_fraction:.0%} "
            f"of queries ≥ {SATURATION} at d_k = {large}) and commits to one item; when it is the wrong one the "
            f"answer is confidently wrong and costs ln(e^{experiment.answer_gain:g} + {experiment.labels - 1}) = "
            f"{experiment.confident_wrong_loss:.2f} nats, so {wrong:.0%} wrong answers cost about "
            f"{wrong * experiment.confident_wrong_loss:.2f}.",
            f"The gradient that could fix it vanishes: ‖∂L/∂W_q‖ is below {VANISHED:g} on "
            f"{raw_large.vanished_gradient_fraction:.0%} of the logged steps (median "
            f"{raw_large.median_grad_norm_q:.3g}; scaled: {runs[(large, True)].median_grad_norm_q:.3g}).",
        ],
        pictures=[
            StoryPicture("story-7-loss", "loss over training, with and without the scale (chance loss marked)"),
            StoryPicture("story-7-accuracy", "accuracy over training"),
            StoryPicture("story-7-gradient", "‖∂L/∂W_q‖ over training (log scale)"),
        ],
    )


def long_context_step(result: AnalysisResult) -> StoryStep | None:
    """Retrieval scores per layer × head and the short-cache plan per layer × KV head, when either ran."""
    retrieval = result.report("find_retrieval_heads", FindRetrievalHeadsReport)
    plan = result.report("plan_kv_cache", PlanKvCacheReport)
    u_curve = result.report("position_sensitivity", PositionSensitivityReport)
    sentences = long_context_sentences(retrieval, plan, u_curve)
    if not sentences:
        return None
    pictures = []
    if retrieval is not None:
        pictures.append(StoryPicture("story-8-retrieval", "retrieval score per layer × head (mean over the haystacks)"))
    if plan is not None:
        caption = (
            f"loss change per layer × KV head with only the first {plan.sink} + last {plan.window} tokens "
            "(S: given the short cache by the plan)"
        )
        pictures.append(StoryPicture("story-8-kv-plan", caption))
    if u_curve is not None:
        caption = "the U-curve: log p(answer) and attention on the needle against where the needle sits"
        pictures.append(StoryPicture("story-8-u-curve", caption))
    return StoryStep(
        key="long_context",
        number=8,
        title="Reading far back: retrieval heads and a short KV cache",
        question=LONG_CONTEXT_QUESTION,
        sentences=sentences,
        pictures=pictures,
    )


STEPS: tuple[Callable[[AnalysisResult], StoryStep | None], ...] = (
    raw_step,
    scale_step,
    stages_step,
    no_projection_step,
    collapse_step,
    roles_step,
    training_step,
    long_context_step,
)


def build_story(result: AnalysisResult) -> list[StoryStep]:
    """The steps whose tools ran, in the essay's order."""
    return [step for step in (make(result) for make in STEPS) if step is not None]


READ_FIRST_TAIL = {
    "page": "Underlined words link to the glossary at the end; the interactive views (model view, attention view, "
    "neuron view) let you check any number on any head.",
    "terminal": "The glossary at the end defines every unit and metric; with --out, report.html adds the pictures "
    "and the interactive views (model view, attention view, neuron view).",
    "notebook": "The glossary at the end defines every unit and metric; result.page() shows the interactive views "
    "(model view, attention view, neuron view).",
}


def read_first(result: AnalysisResult, *, where: str = "page") -> str:
    """Where a learner should start reading this report, for the page, the terminal or a notebook."""
    steps = build_story(result)
    first = steps[0].title if steps else "the findings"
    start = f"Read the story from the top: it starts at '{first}' and adds one piece per step, each with a picture."
    return f"{start} {READ_FIRST_TAIL[where]}"
