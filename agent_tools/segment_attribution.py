"""Prompt segments' effects on an answer by attribution, the top ones verified by exact ablation (issue 26).

One forward and one backward of the clean prompt (``Inspector.embedding_attribution``) estimate, for every segment
at once, the change of the answer's teacher-forced Σ log p when the segment is replaced by neutral tokens:
``(e_neutral − e_clean) · ∂ Σ log p(answer) / ∂e`` over the segment's positions. The estimates only choose which
segments are ablated exactly: the :data:`VERIFIED` largest |estimates| and :data:`SAMPLED` segment drawn at random
(seeded) from the rest, so n segments cost about three forwards plus four exact checks instead of n. Only exact
values are results; the estimates stand beside them, with the rank agreement, the largest exact effect found
outside the top (the random draw: what the ranking may have missed) and the largest estimate left unchecked.

* :func:`choose_segments` — the estimates and the choice (what ``trace_prompt_attention``'s causal check calls
  when it has more than ``VERIFIED + SAMPLED`` content segments; with fewer every segment is checked exactly);
* :func:`segment_check` — the estimate next to each exact value, once the chosen segments were ablated;
* :func:`verified_segment_effects` — both, with the exact neutral-replacement ablation, for a caller with spans.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from agent_tools.analysis.attribution import spearman
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel
from agent_tools.runner.attribution import SegmentVariant, segment_ablations
from agent_tools.schemas import rounded
from agent_tools.session import guarded

VERIFIED = 3  # segments with the largest |estimate| ablated exactly
SAMPLED = 1  # segments drawn at random outside them and ablated exactly (what the ranking may have missed)
SEED = 0


@dataclass(frozen=True)
class SegmentChoice:
    """Every segment's first-order estimate and the segments chosen for exact ablation."""

    estimates: list[float]  # per segment (the order given), Δ Σ log p(answer) with it neutral, to first order
    verified: list[int]  # the largest |estimate| first
    sampled: list[int]  # drawn at random from the rest

    @property
    def chosen(self) -> list[int]:
        return self.verified + self.sampled


@dataclass(frozen=True)
class SegmentCheck:
    """Estimates against exact ablation on the segments ablated exactly (every number Δ Σ log p, neutral)."""

    estimated: int  # segments estimated
    rows: list[tuple[int, float, float]]  # (segment, estimate, exact) for every segment ablated exactly
    verified: list[int]  # the top by |estimate|
    sampled: list[int]  # the random draw outside them
    spearman: float | None  # rank agreement of |estimate| and |exact| over the segments ablated exactly
    missed: tuple[int, float] | None  # the largest exact |effect| among the sampled segments (segment, exact)
    largest_unchecked_estimate: float | None  # the largest |estimate| of a segment not ablated (not a result)


def choose_segments(
    inspector: Inspector,
    loaded: LoadedModel,
    prompt: Sequence[int],
    answer: Sequence[int],
    neutral: Sequence[Sequence[int]],
    *,
    verify: int = VERIFIED,
    sample: int = SAMPLED,
) -> SegmentChoice:
    """Estimate each variant's effect on Σ log p(answer) by attribution and choose the ones to ablate exactly.

    Args:
        prompt: the prompt's ids; ``answer``: the answer's ids (teacher-forced after the prompt).
        neutral: per segment, the prompt with that segment's tokens replaced by the neutral token (same length).
        verify: how many of the largest |estimates| to check exactly (at least 1); ``sample``: how many more at
            random from the rest.
    """
    if verify < 1:
        raise InvalidInputError("verify must check at least one segment exactly", field="verify")
    if not answer:
        raise InvalidInputError("the answer has no tokens to measure", field="answer")
    for variant in neutral:
        if len(variant) != len(prompt):
            msg = (
                f"a neutral variant is {len(variant)} tokens, the prompt {len(prompt)}: the estimate compares "
                "embeddings position by position, so a segment must be replaced by as many neutral tokens"
            )
            raise InvalidInputError(msg, field="segments")
    estimated = inspector.embedding_attribution(loaded, list(prompt) + list(answer[:-1]), list(answer), neutral)
    estimates = [float(v) for v in estimated.estimates]
    order = sorted(range(len(estimates)), key=lambda i: -abs(estimates[i]))
    rest = order[verify:]
    sampled = sorted(random.Random(SEED).sample(rest, min(sample, len(rest))))
    return SegmentChoice(estimates=estimates, verified=order[:verify], sampled=sampled)


def segment_check(choice: SegmentChoice, exact: dict[int, float]) -> SegmentCheck:
    """``exact``: segment -> its exact Δ Σ log p(answer) with it replaced by neutral tokens, for the chosen ones."""
    chosen = [i for i in choice.chosen if i in exact]
    estimates = [choice.estimates[i] for i in chosen]
    values = [exact[i] for i in chosen]
    outside = [(i, exact[i]) for i in choice.sampled if i in exact]
    unchecked = [abs(v) for i, v in enumerate(choice.estimates) if i not in exact]
    return SegmentCheck(
        estimated=len(choice.estimates),
        rows=list(zip(chosen, estimates, values, strict=True)),
        verified=list(choice.verified),
        sampled=list(choice.sampled),
        spearman=spearman([abs(v) for v in estimates], [abs(v) for v in values]) if len(chosen) > 1 else None,
        missed=max(outside, key=lambda x: abs(x[1])) if outside else None,
        largest_unchecked_estimate=max(unchecked) if unchecked else None,
    )


@dataclass(frozen=True)
class SegmentEffects:
    """Every segment's first-order estimate and the exact effect of the ones verified."""

    estimates: list[float]  # per segment, Δ Σ log p(answer) to first order (ranking only)
    verified: list[int]  # segment indices ablated exactly, largest |estimate| first
    exact: list[float]  # their exact Δ Σ log p(answer), neutral replacement
    spearman: float | None  # rank agreement of |estimate| and |exact| over the verified segments
    largest_unverified_estimate: float | None  # the largest |estimate| not verified (what a check may have missed)


def verified_segment_effects(
    inspector: Inspector,
    loaded: LoadedModel,
    prompt: list[int],
    answer: list[int],
    spans: Sequence[tuple[int, int]],
    *,
    neutral_token: int,
    verify: int = VERIFIED,
) -> SegmentEffects:
    """Estimate every segment's effect on log p(answer) by attribution; ablate the ``verify`` largest exactly.

    Args:
        prompt: the prompt's ids; ``answer``: the answer's ids (teacher-forced after the prompt).
        spans: each segment's [start, end) token positions in ``prompt``.
        neutral_token: the id that replaces a segment's tokens (the trace's neutral filler).
        verify: how many segments are ablated exactly (at least 1).
    """
    for start, end in spans:
        if not 0 <= start < end <= len(prompt):
            msg = f"segment span [{start}, {end}) is outside the prompt's {len(prompt)} tokens"
            raise InvalidInputError(msg, field="segments")
    variants = [list(prompt[:start]) + [neutral_token] * (end - start) + list(prompt[end:]) for start, end in spans]
    choice = choose_segments(inspector, loaded, prompt, answer, variants, verify=verify, sample=0)
    checks = [
        SegmentVariant(start=spans[i][0], removed=prompt[: spans[i][0]] + prompt[spans[i][1] :], neutral=variants[i])
        for i in choice.verified
    ]
    with guarded(loaded):
        measured = segment_ablations(loaded, prompt, answer, checks)
    clean = float(measured.clean.sum())
    exact = [float(row.sum()) - clean for row in measured.neutral]
    checked = segment_check(choice, dict(zip(choice.verified, exact, strict=True)))
    return SegmentEffects(
        estimates=choice.estimates,
        verified=choice.verified,
        exact=exact,
        spearman=checked.spearman,
        largest_unverified_estimate=checked.largest_unchecked_estimate,
    )


def choice_for_trace(
    inspector: Inspector,
    loaded: LoadedModel,
    prompt: Sequence[int],
    answer: Sequence[int],
    neutral: Sequence[Sequence[int]],
    notes: list[str],
) -> SegmentChoice | None:
    """The trace's causal check: None (ablate every segment exactly, as cheap) with at most VERIFIED + SAMPLED
    segments, or when the estimate cannot run on this model (a note says why); else the attribution's choice."""
    if len(neutral) <= VERIFIED + SAMPLED:
        return None
    try:
        return choose_segments(inspector, loaded, prompt, answer, neutral)
    except (InvalidInputError, ResourceLimitError) as exc:
        notes.append(f"causal check: every segment ablated exactly (the attribution estimate could not run: {exc})")
        return None


def unchecked_note(names: Sequence[str], check: SegmentCheck) -> str:
    """The note for the segments the causal check estimated but did not ablate (no number of theirs is a result)."""
    largest = check.largest_unchecked_estimate
    return (
        f"causal check: {len(names)} of {check.estimated} segments not ablated ({', '.join(repr(n) for n in names)}): "
        f"attribution ranked them below the {len(check.verified)} ablated exactly"
        + (f" (their largest |first-order estimate| {largest:.2f} nats, not a measured effect)" if largest else "")
    )


class SegmentEstimate(BaseModel):
    """One segment ablated exactly: the exact Δ Σ log p(answer) with it replaced by neutral tokens, and the
    first-order estimate that chose it beside it."""

    segment: str
    exact: float = Field(description="Δ Σ log p(answer tokens), segment replaced by neutral tokens (measured)")
    estimate: float = Field(description="attribution's first-order estimate of the same (what ranked it)")
    chosen: Literal["top", "random"] = Field(description="top: a largest |estimate|; random: drawn from the rest")


class CausalAttribution(BaseModel):
    """How the causal check chose what to ablate: every segment estimated by attribution (one forward and one
    backward), the top ones and a random one ablated exactly. Only the exact values are results."""

    estimated: int = Field(description="segments estimated")
    checked: list[SegmentEstimate] = Field(description="the segments ablated exactly, estimate beside exact")
    spearman: float | None = Field(description="rank agreement of |estimate| and |exact| over the checked segments")
    missed: SegmentEstimate | None = Field(
        description="the largest exact effect among the random draws (what the ranking may have missed)"
    )
    unchecked: list[str] = Field(description="segments not ablated: no causal number of theirs is reported")


def causal_attribution(check: SegmentCheck, segments: Sequence[int], names: Sequence[str]) -> CausalAttribution:
    """The report block of a :class:`SegmentCheck` whose rows index ``segments`` (segment indices of ``names``)."""
    rows = [
        SegmentEstimate(
            segment=names[segments[r]],
            exact=rounded(exact),
            estimate=rounded(estimate),
            chosen="top" if r in check.verified else "random",
        )
        for r, estimate, exact in check.rows
    ]
    by_row = {r: row for (r, _, _), row in zip(check.rows, rows, strict=True)}
    checked = {r for r, _, _ in check.rows}
    return CausalAttribution(
        estimated=check.estimated,
        checked=rows,
        spearman=rounded(check.spearman) if check.spearman is not None else None,
        missed=by_row[check.missed[0]] if check.missed is not None else None,
        unchecked=[names[segments[r]] for r in range(len(segments)) if r not in checked],
    )
