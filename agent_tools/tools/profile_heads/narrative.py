"""profile_heads' words: the summary and findings, written from numbers the plan has already computed."""

from __future__ import annotations

from dataclasses import dataclass

from agent_tools.analysis.heads import HeadRole, SequenceLayout
from agent_tools.schemas import Finding, rounded
from agent_tools.tools.profile_heads.models import HeadProfiles, RoleReport


@dataclass(frozen=True)
class InductionLosses:
    """Mean next-token losses on the probe (nats, unrounded): first copy, second copy, second copy ablated."""

    first: float
    second: float
    ablated: float
    heads: list[str]  # the top induction heads removed together, as "L.H"


def why_unmeasured(role: HeadRole, layout: SequenceLayout | None) -> str:
    """Why a role asked for got no score (``layout``: the text's, None when no text pass ran)."""
    if role == "next_token":
        return "a causal model's query cannot see the next token"
    if role == "special_token":
        return "the text has no special token after the first position"
    if role == "punctuation":
        return "the text has no punctuation token after the first position"
    return "the sequence is too short" if layout is not None else "not scored"


def _baseline_text(report: RoleReport, spread: float | None) -> str:
    """What uniform attention would score, and the spread over probe seeds, as a parenthesis."""
    parts = []
    if report.uniform_baseline is not None:
        parts.append(f"uniform attention would score {report.uniform_baseline:.3f}")
    if spread is not None:
        parts.append(f"± {spread:.3f} over the probe seeds")
    return f" ({'; '.join(parts)})" if parts else ""


def role_finding(report: RoleReport) -> Finding:
    """The role's top head, its score against the uniform baseline and (when measured) what ablating it did."""
    lead = report.top[0]
    proof = (
        f"; ablating it gives {lead.ablation.metric} {lead.ablation.value:+.4g}" if lead.ablation is not None else ""
    )
    return Finding(
        kind=report.role,
        layer=lead.layer,
        head=lead.head,
        value=lead.score,
        detail=f"L{lead.layer}H{lead.head} is the top {report.role} head: {report.formula} = {lead.score:.3f} "
        f"on the {report.measured_on}{_baseline_text(report, lead.spread)} ({report.heads_with_role} heads reach "
        f"{report.threshold}){proof}",
    )


def induction_finding(losses: InductionLosses) -> Finding:
    """The behavioural check: the model copies when its loss falls on the second copy, and needs these heads."""
    return Finding(
        kind="induction_behaviour",
        value=rounded(losses.first - losses.second),
        detail=f"next-token loss falls from {losses.first:.3f} nats on the probe's first copy to {losses.second:.3f} "
        f"on the second; removing heads {', '.join(losses.heads)} raises it to {losses.ablated:.3f}",
    )


def _inputs_text(report: HeadProfiles) -> str:
    """What the scores were measured on: the text (or the sample) and/or the probe."""
    where = []
    if report.text_tokens is not None:
        text = "the text" if report.text_source == "user" else "the built-in sample text"
        where.append(f"{text} ({report.text_tokens} tokens)")
    if report.probe is not None:
        seeds = report.probe.seeds or [report.probe.seed]
        label = f"seed-{seeds[0]} probe" if len(seeds) == 1 else f"{len(seeds)} probes (seeds {seeds[0]}–{seeds[-1]})"
        where.append(f"{label} of 2×{report.probe.repeat_length} random tokens")
    return " and ".join(where)


def _leaders_text(roles: list[RoleReport]) -> str:
    """Each role's top head and score, with its ablation evidence when measured."""
    return "; ".join(
        f"{r.role} L{r.top[0].layer}H{r.top[0].head} {r.top[0].score:.3f}"
        + (f" vs uniform {r.uniform_baseline:.3f}" if r.uniform_baseline is not None else "")
        + (f" (ablated: {r.top[0].ablation.metric} {r.top[0].ablation.value:+.4g})" if r.top[0].ablation else "")
        for r in roles
    )


def _census_text(report: HeadProfiles) -> str:
    """How many heads have each primary role, most common first ("none": no role reached its threshold)."""
    counts: dict[str, int] = {}
    for profile in report.heads:
        counts[profile.primary_role or "none"] = counts.get(profile.primary_role or "none", 0) + 1
    return ", ".join(f"{n} {role}" for role, n in sorted(counts.items(), key=lambda item: -item[1]))


def summary(report: HeadProfiles) -> str:
    """Two or three sentences from a report whose numbers are filled in (its own summary is ignored)."""
    text = (
        f"Profiled {len(report.heads)} heads ({len(report.layers)} layers × {report.num_heads}) of {report.model} on "
        f"{_inputs_text(report)}. Top head per role: {_leaders_text(report.roles)}. "
        f"Primary roles: {_census_text(report)}."
    )
    check = report.induction_check
    if check is not None:
        text += (
            f" Induction check: loss {check.loss_first_copy:.3f} → {check.loss_second_copy:.3f} nats from the first "
            f"to the second copy; {check.loss_second_copy_ablated:.3f} with {', '.join(check.ablated_heads)} removed."
        )
    if report.unmeasured:
        text += " Not measurable here: " + "; ".join(f"{r} ({why})" for r, why in report.unmeasured.items()) + "."
    return text
