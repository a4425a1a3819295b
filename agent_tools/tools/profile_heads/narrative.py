"""profile_heads' words: the summary and findings, written from numbers the plan has already computed.

A head "is" a role's head only when its score reaches the threshold *and* its ablation check beat removing random
heads; otherwise the words say what was measured ("attends like a previous-token head, but removing it changes
little"). Every effect is given with its direction and the random heads' mean ± spread.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from agent_tools.analysis.heads import HeadRole, SequenceLayout
from agent_tools.analysis.metrics import Baseline
from agent_tools.schemas import Finding, NextCall, follow_up, head_label, rounded
from agent_tools.tools.profile_heads.models import (
    SAMPLE_TEXT,
    AblationEvidence,
    HeadProfiles,
    PatternTop,
    ProfileHeadsInput,
    RoleReport,
    TopHead,
)
from agent_tools.wording import head_name, head_names, signed


@dataclass(frozen=True)
class InductionLosses:
    """Mean next-token losses on the probe (nats, unrounded): first copy, second copy, second copy with the top
    induction heads mean-ablated together; the random sets' changes of the second-copy loss."""

    first: float
    second: float
    ablated: float
    heads: list[str]  # the top induction heads removed together, as "L.H"
    baseline: Baseline  # the random sets' changes of the second-copy loss
    exceeds: bool


def why_unmeasured(role: HeadRole, layout: SequenceLayout | None) -> str:
    """Why a role asked for got no score (``layout``: the text's, None when no text pass ran)."""
    if role == "next_token":
        return "a causal model's query cannot see the next token"
    if role == "special_token":
        return "the text has no special token after the first position"
    if role == "punctuation":
        return "the text has no punctuation token after the first position"
    return "the sequence is too short" if layout is not None else "not scored"


def _role_words(role: str) -> str:
    return role.replace("_", "-")


def _a(words: str) -> str:
    return f"{'an' if words[0] in 'aeiou' else 'a'} {words}"


def score_text(report: RoleReport, head: TopHead) -> str:
    """``score 0.91 ± 0.03 over 3 texts`` (one input: ``score 0.91 on the text``)."""
    unit = "probes" if report.measured_on == "probe" else "texts"
    if head.spread is None or report.inputs < 2:
        return f"score {head.score:.2f} on the {report.measured_on}"
    return f"score {head.score:.2f} ± {head.spread:.2f} over {report.inputs} {unit}"


def effect_text(evidence: AblationEvidence) -> str:
    """What mean-ablating the head did, with its direction, and what random heads do."""
    value = evidence.value
    if evidence.metric == "pooled_cosine_change":
        said = f"mean-ablation changes the pooled embedding by 1 − cos = {value:.2g}"
    else:
        where = "probe's second-copy loss" if evidence.metric == "second_copy_loss_change" else "text's next-token loss"
        said = f"mean-ablation {'raises' if value >= 0 else 'lowers'} the {where} by {abs(value):.2f} nats"
    if evidence.baseline_draws and evidence.baseline_mean is not None:
        mean, spread = signed(evidence.baseline_mean), evidence.baseline_spread
        said += f"; {evidence.baseline_draws} random heads: {mean} ± {spread:.2f}"
    return said


def head_sentence(report: RoleReport, head: TopHead) -> str:
    """The verdict in words: "is" only when score and ablation check agree."""
    where, kind = head_name(head.layer, head.head), _a(f"{_role_words(report.role)} head")
    score = score_text(report, head)
    if head.verdict == "below_threshold":
        role = _role_words(report.role)
        return f"no head reaches the {role} threshold {report.threshold}; the closest is {where} ({score})"
    if head.verdict == "is_role" and head.ablation is not None:
        return f"{where} is {kind} ({score}; {effect_text(head.ablation)})"
    if head.verdict == "attends_only" and head.ablation is not None:
        return f"{where} attends like {kind} ({score}), but removing it changes little ({effect_text(head.ablation)})"
    if report.ablation_check is None:
        why = "this role has no ablation check"
    elif head.ablation is None:
        why = "its ablation check was not run"
    else:
        why = "its check needs a next-token head"
    measured = f"; {effect_text(head.ablation)}" if head.ablation is not None else ""
    return f"{where} attends like {kind} ({score}{measured}; {why})"


def role_finding(report: RoleReport) -> Finding:
    """The role's top head: its verdict sentence, against the uniform baseline."""
    lead = report.top[0]
    uniform = f"; uniform attention scores {report.uniform_baseline:.3f}" if report.uniform_baseline is not None else ""
    return Finding(
        kind=report.role,
        layer=lead.layer,
        head=lead.head,
        value=lead.score,
        detail=f"{head_sentence(report, lead)}. {report.formula}{uniform}; {report.heads_with_role} heads reach "
        f"{report.threshold} on the {report.measured_on}",
    )


def induction_finding(losses: InductionLosses) -> Finding:
    """The behavioural check: the model copies when its loss falls on the second copy, and needs these heads."""
    drawn = (losses.baseline.draws, losses.baseline.mean, losses.baseline.spread)
    return Finding(
        kind="induction_behaviour",
        value=rounded(losses.first - losses.second),
        detail=f"next-token loss falls from {losses.first:.3f} nats on the probe's first copy to {losses.second:.3f} "
        f"on the second; {_joint_text(losses.ablated - losses.second, losses.heads, drawn, losses.exceeds)}",
    )


def _joint_text(rise: float, heads: list[str], baseline: tuple[int, float, float], exceeds: bool) -> str:
    """``baseline``: the random sets' draws, mean and spread."""
    draws, mean, spread = baseline
    said = f"mean-ablating {head_names(heads)} together {'raises' if rise >= 0 else 'lowers'} it by {abs(rise):.2f}"
    if draws:
        said += f" ({draws} random sets of {len(heads)}: {signed(mean)} ± {spread:.2f})"
    return said + ("" if exceeds else ", no more than random heads")


def _inputs_text(report: HeadProfiles) -> str:
    """What the scores were measured on: the text (or the sample), held-out texts and/or the probe."""
    where = []
    if report.text_tokens is not None:
        text = "the text" if report.text_source == "user" else "the built-in sample text"
        held = f" + {report.held_out_texts} held-out texts" if report.held_out_texts else ""
        where.append(f"{text} ({report.text_tokens} tokens){held}")
    if report.probe is not None:
        seeds = report.probe.seeds or [report.probe.seed]
        label = f"seed-{seeds[0]} probe" if len(seeds) == 1 else f"{len(seeds)} probes (seeds {seeds[0]}–{seeds[-1]})"
        where.append(f"{label} of 2×{report.probe.repeat_length} random tokens")
    return " and ".join(where)


def _top_text(lead: TopHead | PatternTop) -> str:
    """``L1H0 0.912 ± 0.031``: a top head, its mean and spread."""
    spread = f" ± {lead.spread:.3f}" if lead.spread is not None else ""
    return f"{head_name(lead.layer, lead.head)} {lead.score:.3f}{spread}"


def _leader(report: RoleReport) -> str:
    """One role's top head, its mean ± spread vs uniform, and the verdict in a word."""
    lead = report.top[0]
    text = f"{report.role} {_top_text(lead)}"
    if report.uniform_baseline is not None:
        text += f" vs uniform {report.uniform_baseline:.3f}"
    evidence = lead.ablation
    if evidence is not None and evidence.baseline_mean is not None:
        word = {"is_role": "is one", "attends_only": "attends only"}.get(lead.verdict, "ablated")
        text += (
            f" ({word}: ablation {signed(evidence.value)} vs random {signed(evidence.baseline_mean)} ± "
            f"{evidence.baseline_spread:.2f})"
        )
    return text


def _census_text(report: HeadProfiles) -> str:
    """How many heads have each primary role, most common first ("none": no role reached its threshold)."""
    counts = Counter(profile.primary_role or "none" for profile in report.heads)
    return ", ".join(f"{n} {role}" for role, n in counts.most_common())  # ties: in the order first seen


def summary(report: HeadProfiles) -> str:
    """Two or three sentences from a report whose numbers are filled in (its own summary is ignored)."""
    text = (
        f"Profiled {len(report.heads)} heads ({len(report.layers)} layers × {report.num_heads}) of {report.model} on "
        f"{_inputs_text(report)}. Top head per role (mean ± spread over the inputs): "
        f"{'; '.join(_leader(r) for r in report.roles)}. Primary roles on the text: {_census_text(report)}."
    )
    check = report.induction_check
    if check is not None and check.loss_second_copy_ablated is not None:
        baseline = (
            check.baseline_draws,
            (check.baseline_mean or check.loss_second_copy) - check.loss_second_copy,
            check.baseline_spread or 0.0,
        )
        rise = check.loss_second_copy_ablated - check.loss_second_copy
        text += (
            f" Induction check: loss {check.loss_first_copy:.3f} → {check.loss_second_copy:.3f} nats from the first "
            f"to the second copy; {_joint_text(rise, check.ablated_heads, baseline, check.exceeds_baseline)}."
        )
    for pattern in report.patterns:
        if pattern.top:
            text += f" Pattern {pattern.name}: {_top_text(pattern.top[0])}."
    if report.unmeasured:
        text += " Not measurable here: " + "; ".join(f"{r} ({why})" for r, why in report.unmeasured.items()) + "."
    return text


def next_calls(args: ProfileHeadsInput, report: HeadProfiles) -> list[NextCall]:
    """Ablate the top head of each role with an ablation check on the text: does the model need what it does there?"""
    text = args.text if args.text is not None else SAMPLE_TEXT
    return [
        follow_up(
            "ablate_heads",
            {"text": text, "heads": [head_label(lead.layer, lead.head)]},
            f"{head_name(lead.layer, lead.head)} is the top {role.role} head; removing it on your text shows whether "
            "the model needs it there (with its direct logit attribution)",
            model=report.model,
        )
        for role in report.roles
        if role.ablation_check is not None and role.top
        for lead in role.top[:1]
    ]
