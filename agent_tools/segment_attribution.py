"""Prompt segments' effects on an answer by attribution, the top ones verified by exact ablation (issue 26).

:func:`verified_segment_effects` estimates, for every segment at once, the change of the answer's teacher-forced
log-probability when the segment is replaced by neutral tokens: one forward and one backward of the clean prompt
(``Inspector.embedding_attribution``: ``(e_neutral − e_clean) · ∂ Σ log p(answer) / ∂e`` over the segment's
positions). The ``verify`` segments with the largest |estimate| are then ablated exactly
(``Inspector.segment_ablations``, the same neutral replacement), so n segments cost about three forwards plus
``verify`` exact checks instead of n. Only the exact values are results; the estimates rank which to check, and
the returned agreement says how well they did.

How ``trace_prompt_attention``'s causal check would call it (the lead wires it in; ``prompt_trace`` is unchanged
here): where the check today builds one ``SegmentVariant`` per segment and calls ``inspector.segment_ablations``
for all of them, with ``prompt`` (the traced prompt's ids), ``answer`` (the measured answer's ids) and the named
segments' token spans ``[(start, end), ...]``::

    effects = verified_segment_effects(
        inspector, loaded, prompt, answer, spans, neutral_token=neutral_id, verify=3
    )
    # effects.exact[i] is Δ Σ log p(answer) when segment effects.verified[i] is replaced by neutral tokens
    # (negative: the answer depends on it); effects.estimates[j] ranks every segment, never shown as a result;
    # effects.spearman and effects.largest_unverified_estimate say what the ranking may have missed.

and report ``effects.verified`` segments with their exact values (removal, which changes the length, stays an
exact check of the verified segments only: the estimate needs a same-length variant).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent_tools.analysis.attribution import spearman
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel
from agent_tools.runner.attribution import SegmentVariant


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
    verify: int = 3,
) -> SegmentEffects:
    """Estimate every segment's effect on log p(answer) by attribution; ablate the ``verify`` largest exactly.

    Args:
        prompt: the prompt's ids; ``answer``: the answer's ids (teacher-forced after the prompt).
        spans: each segment's [start, end) token positions in ``prompt``.
        neutral_token: the id that replaces a segment's tokens (the trace's neutral filler).
        verify: how many segments are ablated exactly (at least 1).
    """
    if verify < 1:
        raise InvalidInputError("verify must check at least one segment exactly", field="verify")
    if not answer:
        raise InvalidInputError("the answer has no tokens to measure", field="answer")
    for start, end in spans:
        if not 0 <= start < end <= len(prompt):
            msg = f"segment span [{start}, {end}) is outside the prompt's {len(prompt)} tokens"
            raise InvalidInputError(msg, field="segments")
    variants = [list(prompt[:start]) + [neutral_token] * (end - start) + list(prompt[end:]) for start, end in spans]
    estimated = inspector.embedding_attribution(loaded, list(prompt) + list(answer[:-1]), answer, variants)
    estimates = [float(v) for v in estimated.estimates]
    order = sorted(range(len(spans)), key=lambda i: -abs(estimates[i]))
    chosen = order[:verify]
    checks = [
        SegmentVariant(start=spans[i][0], removed=prompt[: spans[i][0]] + prompt[spans[i][1] :], neutral=variants[i])
        for i in chosen
    ]
    measured = inspector.segment_ablations(loaded, prompt, answer, checks)
    clean = float(measured.clean.sum())
    exact = [float(row.sum()) - clean for row in measured.neutral]
    rest = [abs(estimates[i]) for i in order[verify:]]
    return SegmentEffects(
        estimates=estimates,
        verified=chosen,
        exact=exact,
        spearman=spearman([abs(estimates[i]) for i in chosen], [abs(v) for v in exact]) if len(chosen) > 1 else None,
        largest_unverified_estimate=max(rest) if rest else None,
    )
