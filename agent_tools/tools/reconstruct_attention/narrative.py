"""reconstruct_attention's words: what each stage adds, the findings and the summary.

Pure functions of numbers the plan has already computed (a :class:`Recipe` read from the pass, and the report's
rounded :class:`~.models.StageReport` per stage and its parity errors); one function per finding kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent_tools.consumers.head_inputs import mask_phrase
from agent_tools.schemas import Finding, NextCall, rounded, text_follow_up
from agent_tools.tools.reconstruct_attention.models import (
    AttentionReconstruction,
    ReconstructAttentionInput,
    StageReport,
)
from agent_tools.wording import head_name, is_standard_scale


@dataclass(frozen=True)
class Recipe:
    """What the head's recipe is made of, read from the pass: the ingredients each stage adds."""

    family: str
    hidden_size: int  # the width of the raw input x
    head_dim: int  # d_k: stage 2 divides x·xᵀ by sqrt(d_k)
    has_bias: bool  # the family adds b_Q or b_K
    query_prescale: float  # != 1.0 where the family folds the scale into W_Q (OPT)
    effective_scale: float  # the factor q·kᵀ is really multiplied by
    rotary_dims: int | None  # dims RoPE rotates; None without RoPE
    positional: str  # ModelFacts.positional
    softcap: float | None
    mask: str  # describe_mask's text
    mask_every_stage: bool
    terms: tuple[str, ...] = ()  # additive score terms with a stage of their own (not the sink logit)
    sink: float | None = None  # the head's learned sink logit (GPT-OSS): a column of the last stage's softmax
    sink_share: float | None = None  # mean weight that column takes on this text


def decisive_stage(stages: list[StageReport]) -> tuple[int, float]:
    """(index into ``stages``, drop): the stage whose ingredient moves the map most towards the model's own (the
    largest drop in masked JS divergence from the stage before, nats), the mask held fixed."""
    drops = [(stages[i - 1].masked_js_to_model - stages[i].masked_js_to_model, i) for i in range(1, len(stages))]
    drop, index = max(drops)
    return index, drop


def _positions_text(recipe: Recipe) -> str:
    if recipe.rotary_dims is None and recipe.terms:
        return f"nothing new: positions enter as an additive score term at stage 5 ({', '.join(recipe.terms)})"
    if recipe.rotary_dims is None:
        return f"nothing new: {recipe.positional} — positions are already in x, so this equals stage 3"
    if recipe.rotary_dims < recipe.head_dim:
        return f"RoPE applied to q and k ({recipe.rotary_dims} of {recipe.head_dim} dims rotated)"
    return "RoPE applied to q and k (all dims rotated)"


def _divided_by(scale: float) -> str:
    """'÷ 8' for a factor of 0.125: what a stage divides its dot products by."""
    return f"÷ {1 / scale:.4g}"


def model_scale_text(recipe: Recipe) -> str:
    """The model's own factor on q·k, as a divisor, and how it compares with 1/sqrt(d_k)."""
    standard = 1 / math.sqrt(recipe.head_dim)
    ratio = recipe.effective_scale / standard
    compared = "= 1/sqrt(d_k)" if is_standard_scale(ratio) else f"= {ratio:.3g}/sqrt(d_k), not the textbook 1/sqrt(d_k)"
    return f"{_divided_by(recipe.effective_scale)} (the model's factor {recipe.effective_scale:.4g} {compared})"


def stage_descriptions(recipe: Recipe) -> list[str]:
    """What each of the five stages adds to the previous one, and what it divides the dot products by."""
    d, d_k = recipe.hidden_size, recipe.head_dim
    bias = " with biases b_Q, b_K" if recipe.has_bias else ""
    prescale = f" (folded into W_Q by {recipe.family})" if recipe.query_prescale != 1.0 else ""
    early = f"; {mask_phrase(recipe.mask)} applied already" if recipe.mask_every_stage else ", every key visible"
    softcap = f"scores soft-capped to c·tanh(s/c) with c = {recipe.softcap}, then " if recipe.softcap else ""
    model_scale = model_scale_text(recipe)
    stages = [
        f"raw dot products x_i·x_j of the layer's input (x has {d} dims), ÷ 1 (not scaled){early}",
        f"divided by sqrt(d_k) = sqrt({d_k}) = {math.sqrt(d_k):.4g} (d_k = {d_k}, the head's dimension; "
        f"not the {d} dims of x)",
        f"q = x W_Q, k = x W_K{bias} ({d_k}-dim head); q·k {model_scale}{prescale}",
        f"{_positions_text(recipe)}; still {_divided_by(recipe.effective_scale)}",
    ]
    if recipe.terms:
        stages.append(
            f"+ {' + '.join(recipe.terms)}: the family's additive term on the scores, as the model computed it "
            f"(not scaled: it is added after q·k {_divided_by(recipe.effective_scale)})"
        )
    sink, lead = "", ""
    if recipe.sink is not None:
        share = (
            f", which takes {recipe.sink_share:.1%} of this head's attention" if recipe.sink_share is not None else ""
        )
        lead = "+ sink logit: "
        sink = (
            f" over the keys and one more column per query holding the head's learned sink logit "
            f"{recipe.sink:.4g}{share}, so the real keys share the rest"
        )
    stages.append(
        f"{lead}{softcap}{mask_phrase(recipe.mask)}, then softmax{sink}: the model's own attention "
        f"(still {_divided_by(recipe.effective_scale)})"
    )
    return stages


def stage_finding(report: StageReport, layer: int, head: int) -> Finding:
    """One stage's entropy, peak, self-share and distance to the model's map."""
    return Finding(
        kind=f"stage_{report.stage}_{report.name}",
        layer=layer,
        head=head,
        value=report.mean_entropy,
        detail=(
            f"stage {report.stage} ({report.name}): entropy {report.mean_entropy:.3f} nats, mean max weight "
            f"{report.mean_max_weight:.3f}, self-share {report.self_share:.3f}, JS to the model "
            f"{report.mean_js_to_model:.3f}"
        ),
    )


def decisive_finding(report: AttentionReconstruction) -> Finding:
    """The ingredient that moves the map most towards the model's, the mask held fixed."""
    decisive, drop = decisive_stage(report.stages)
    before, after = report.stages[decisive - 1], report.stages[decisive]
    return Finding(
        kind="decisive_stage",
        layer=report.layer,
        head=report.head,
        value=rounded(drop),
        detail=(
            f"with the mask held fixed, stage {decisive + 1} ({after.name}) moves the map most towards "
            f"the model's: JS divergence {before.masked_js_to_model:.3f} → {after.masked_js_to_model:.3f} nats"
        ),
    )


def error_finding(report: AttentionReconstruction) -> Finding:
    """How exactly stage 5 equals the model's own weights."""
    return Finding(
        kind="reconstruction_error",
        layer=report.layer,
        head=report.head,
        value=report.model_weight_error,
        detail=(
            f"stage {len(report.stages)} equals the model's weights to {report.model_weight_error:.1e} "
            f"(stage-4 scores to {report.positional_score_error:.1e})"
        ),
    )


def findings(report: AttentionReconstruction) -> list[Finding]:
    """The decisive stage first, then one finding per stage, then the reconstruction error."""
    stages = [stage_finding(stage, report.layer, report.head) for stage in report.stages]
    return [decisive_finding(report), *stages, error_finding(report)]


def summary(recipe: Recipe, report: AttentionReconstruction) -> str:
    """The entropy at every stage, the parity error and the decisive stage, in one paragraph."""
    stages = report.stages
    first, last = stages[0], stages[-1]
    decisive, _ = decisive_stage(stages)
    before, after = stages[decisive - 1], stages[decisive]
    positions = "RoPE" if recipe.rotary_dims is not None else "positions (already in x)"
    if recipe.rotary_dims is None and recipe.terms:
        positions = "positions (as a score term)"
    softcap = " and soft-cap" if recipe.softcap else ""
    terms = f"+ {' + '.join(recipe.terms)} {stages[4].mean_entropy:.3f} → " if recipe.terms else ""
    sink = ""
    if recipe.sink is not None and recipe.sink_share is not None:
        sink = f" with the sink logit (it takes {recipe.sink_share:.1%})"
    return (
        f"Layer {report.layer} head {report.head} rebuilt from its input on {len(report.tokens)} tokens; mean entropy "
        f"per stage: raw x·xᵀ {first.mean_entropy:.3f} nats (self-share {first.self_share:.2f}) → "
        f"÷sqrt(d_k = {recipe.head_dim}) {stages[1].mean_entropy:.3f} → W_Q/W_K {stages[2].mean_entropy:.3f} → "
        f"{positions} {stages[3].mean_entropy:.3f} → {terms}{mask_phrase(recipe.mask)}{softcap}, softmax{sink} "
        f"{last.mean_entropy:.3f} = the model's map (max error {report.model_weight_error:.1e}). With the mask held "
        f"fixed, stage {decisive + 1} ({after.name}) moves it most towards the model's map "
        f"(JS {before.masked_js_to_model:.3f} → {after.masked_js_to_model:.3f} nats)."
    )


def next_calls(args: ReconstructAttentionInput, report: AttentionReconstruction) -> list[NextCall]:
    """The projections behind stage 3, the score scale behind stage 2, and the head's map."""
    where, name = {"layer": report.layer, "head": report.head}, head_name(report.layer, report.head)
    return [
        text_follow_up(
            args,
            "inspect_projections",
            where,
            f"what W_Q, W_K, W_V of {name} look for and offer (spectra, subspaces, no-projection counterfactual)",
        ),
        text_follow_up(args, "explain_scaling", where, f"what the 1/sqrt(d_k) scale does to {name}'s softmax"),
        text_follow_up(args, "show_attention", where, f"{name}'s map, query by query"),
    ]
