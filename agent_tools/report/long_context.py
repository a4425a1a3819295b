"""The ``analyze`` report's long-context section: retrieval heads and the short-cache plan, for texts long enough.

Both steps cost many forwards (``find_retrieval_heads``: one captured pass per haystack and two per ablated head set
and haystack; ``plan_kv_cache``: about 45 forwards' worth on the default model, see
``benchmarks/results-long-context.md``), so the job runs them by default only when the text has at least
:data:`LONG_CONTEXT_TOKENS` tokens (``run_analysis(..., long_context=None)``; ``True`` runs them whatever the
length, ``False`` / ``--no-long-context`` never). Their reports join the job's ``reports`` (and ``report.json``)
under the tools' names; :func:`long_context_sentences` writes the section's sentences from their numbers, and
:mod:`agent_tools.report.figures` draws its pictures (retrieval scores per layer × head, the plan per layer × KV head).

The U-curve (answer accuracy against where a fact sits) needs named segments (``position_sensitivity``); a plain
text has none, so the section says so instead of drawing one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI reads the threshold at start-up: nothing heavy is imported here
    from agent_tools.tools.find_retrieval_heads.models import FindRetrievalHeadsReport
    from agent_tools.tools.plan_kv_cache.models import PlanKvCacheReport

LONG_CONTEXT_TOKENS = 1024  # a shorter text has no "far back" worth measuring
HAYSTACK_TOKENS = 1024  # haystack length built from the text (the needle at three depths)
RETRIEVAL_DEPTHS = [0.1, 0.5, 0.9]
KV_SINK, KV_WINDOW = 4, 256  # the window is at most a quarter of the text, so a quarter of it is always scored
LONG_CONTEXT_QUESTION = (
    "Which heads fetch from far back, and which could keep only the first and the last tokens? (What a retrieval "
    "score and a loss change measure: the two long-context sections below.)"
)
NO_U_CURVE = (
    "How accuracy depends on where a fact sits (the U-curve) needs named segments to move around "
    "(position_sensitivity); a plain text has none, so no U-curve is drawn here."
)


def long_context_steps(
    text: str, model: str | None, tokens: int, *, threshold: int = LONG_CONTEXT_TOKENS
) -> list[tuple[str, dict[str, Any]]] | str:
    """The (tool, arguments) of the long-context steps, or why there are none for this text (fewer than
    ``threshold`` tokens)."""
    if tokens < threshold:
        return f"text has {tokens} tokens; the long-context steps need at least {threshold}"
    base: dict[str, Any] = {"detail": "full"} | ({"model": model} if model else {})
    window = min(KV_WINDOW, tokens // 4)
    return [
        (
            "find_retrieval_heads",
            base
            | {"text": text, "lengths": [min(HAYSTACK_TOKENS, tokens)], "depths": RETRIEVAL_DEPTHS, "random_draws": 2},
        ),
        ("plan_kv_cache", base | {"text": text, "sink": KV_SINK, "window": window, "context_length": tokens}),
    ]


def _retrieval_sentences(report: FindRetrievalHeadsReport) -> list[str]:
    lengths = sorted({h.length for h in report.haystacks})
    depths = sorted({h.depth for h in report.haystacks})
    accuracy = sum(h.accuracy for h in report.haystacks) / max(1, len(report.haystacks))
    where = (
        f"Over {len(report.haystacks)} needle-in-a-haystack prompts built from this text "
        f"({', '.join(str(n) for n in lengths)} tokens; the needle at depths {', '.join(f'{d:g}' for d in depths)})"
    )
    if report.heads:
        best = report.heads[0]
        heads = (
            f"{len(report.heads)} heads score above 0; the best, L{best.layer}H{best.head}, scores {best.score:.2f} "
            f"± {best.score_sd:.2f} (mean ± sd over the prompts)."
        )
    else:
        heads = "no head scores above 0."
    first = f"{where}, the model copies {accuracy:.0%} of the answer tokens; {heads}"
    causal = report.causal
    if causal.accuracy_clean > 0:
        second = (
            f"Ablating the top {len(causal.ablated)} heads ({', '.join(causal.ablated)}) together leaves "
            f"{causal.accuracy_top_ablated:.0%} answer-token accuracy (full model {causal.accuracy_clean:.0%}), "
            f"against {causal.accuracy_random_mean:.0%} ± {causal.accuracy_random_sd:.0%} with "
            f"{len(causal.ablated)} random heads ({causal.random_draws} draws)."
        )
    else:
        second = "The full model retrieves none of the answer, so ablating heads cannot show which it needs."
    return [first, second]


def _plan_sentence(report: PlanKvCacheReport) -> str:
    plan, memory = report.plan, report.memory
    hurting = sorted((h for h in report.heads if h.loss_change > 0), key=lambda h: -h.loss_change)[:2]
    most = ", ".join(f"L{h.layer}KV{h.kv_head} {h.loss_change:+.4f} nats" for h in hurting)
    needing = f"the heads needing the full cache most: {most}" if hurting else "no head's loss rises when restricted"
    return (
        f"Keeping only the first {report.sink} and last {report.window} tokens, {plan.planned_kv_heads} of "
        f"{plan.total_kv_heads} KV heads fit the {report.loss_budget:g}-nat loss budget: run together they change "
        f"the loss by {plan.verified_loss_change:+.4f} nats (top next token unchanged at "
        f"{plan.verified_top_token_agreement:.0%} of {report.scored_positions} positions), saving "
        f"{memory.saved_fraction:.0%} of the KV cache at {memory.context_length} tokens in {memory.precision}; "
        f"{needing}."
    )


def long_context_sentences(
    retrieval: FindRetrievalHeadsReport | None, plan: PlanKvCacheReport | None, *, u_curve: bool = False
) -> list[str]:
    """The section's sentences, each a function of the reports' numbers (empty when neither ran)."""
    if retrieval is None and plan is None:
        return []
    sentences = _retrieval_sentences(retrieval) if retrieval is not None else []
    if plan is not None:
        sentences.append(_plan_sentence(plan))
    if not u_curve:
        sentences.append(NO_U_CURVE)
    return sentences


def plan_grid(report: PlanKvCacheReport) -> tuple[list[list[float]], list[list[str]]]:
    """(loss change, mark) per layer × KV head, row = layer: "S" where the plan gives the head the short cache,
    "-" on a layer that was not measured (its loss change shown as 0)."""
    layers = max((h.layer for h in report.heads), default=-1) + 1
    kv_heads = max((h.kv_head for h in report.heads), default=-1) + 1
    values = [[0.0] * kv_heads for _ in range(layers)]
    marks = [["-"] * kv_heads for _ in range(layers)]
    for h in report.heads:
        values[h.layer][h.kv_head] = h.loss_change
        marks[h.layer][h.kv_head] = "S" if h.planned else ""
    return values, marks
