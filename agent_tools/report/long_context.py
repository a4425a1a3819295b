"""The ``analyze`` report's long-context section: retrieval heads and the short-cache plan, for texts long enough.

The steps cost many forwards (``find_retrieval_heads``: one captured pass per haystack and two per ablated head set
and haystack; ``plan_kv_cache``: about 40 forwards' worth to measure every KV head on the default model plus up to
18 single-row verifying runs, see ``benchmarks/results-long-context.md``; ``position_sensitivity``: five captured
passes of at most :data:`U_CURVE_TOKENS` tokens), so the job runs them by default only when the text has at least
:data:`LONG_CONTEXT_TOKENS` tokens (``run_analysis(..., long_context=None)``; ``True`` runs them whatever the
length, ``False`` / ``--no-long-context`` never). Their reports join the job's ``reports`` (and ``report.json``)
under the tools' names; :func:`long_context_sentences` writes the section's sentences from their numbers, and
:mod:`agent_tools.report.figures` draws its pictures (retrieval scores per layer × head, the plan per layer × KV head).

The U-curve (``position_sensitivity``) needs named segments; a plain text has none, so the section states its own
choice (:func:`u_curve_arguments`): the retrieval step's needle sentence, moved through the five slots among four
parts of the text (cut at sentence ends near its quarters, at most :data:`U_CURVE_TOKENS` tokens of prompt in all),
the needle's question at the end and its answer measured. When the text cannot be cut into four parts, the section
says why no U-curve is drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agent_tools.wording import head_name

if TYPE_CHECKING:  # the CLI reads the threshold at start-up: nothing heavy is imported here
    from agent_tools.tools.find_retrieval_heads.models import FindRetrievalHeadsReport
    from agent_tools.tools.plan_kv_cache.models import PlanKvCacheReport
    from agent_tools.tools.position_sensitivity.models import PositionSensitivityReport

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
    "(position_sensitivity); this text could not be cut into four parts around the needle within the model's "
    "limit, so no U-curve is drawn here."
)
U_CURVE_TOKENS = 1024  # the U-curve prompt (text parts, needle, question) at most, so 5 passes stay cheap
U_CURVE_PARTS = 4  # parts of the text the needle moves among (5 slots)
# the needle, question and answer of find_retrieval_heads' defaults (agent_tools.long_context), repeated here so the
# CLI's start-up imports nothing heavy; test_long_context checks they are the same
U_CURVE_NEEDLE = "The secret passphrase for the vault is amber falcon river."
U_CURVE_QUESTION = "Question: what is the secret passphrase for the vault? Answer: the secret passphrase is"
U_CURVE_ANSWER = " amber falcon river"


def _parts(text: str, count: int) -> list[str]:
    """``text`` cut into ``count`` non-empty parts at the first sentence end (else space) after each quarter."""
    parts, start = [], 0
    for index in range(1, count):
        target = max(start + 1, index * len(text) // count)
        cut = text.find(". ", target)
        cut = cut + 1 if cut >= 0 else text.find(" ", target)
        if cut < 0:
            return []
        parts.append(text[start:cut].strip())
        start = cut
    parts.append(text[start:].strip())
    return parts if all(parts) else []


def u_curve_arguments(
    text: str, tokens: int, count: Callable[[str], int] | None = None, *, limit: int = U_CURVE_TOKENS
) -> dict[str, Any] | None:
    """position_sensitivity's arguments for a plain text (None when it cannot be cut into four parts).

    The text is cut so the prompt takes about ``limit`` tokens (by the text's characters per token; ``count`` — the
    model's token count — shrinks it further until prompt and answer fit), then into four parts; the needle is a
    fifth segment, moved through the five slots."""
    budget = max(1, limit)
    chars_per_token = len(text) / max(1, tokens)
    extra = len(U_CURVE_NEEDLE) + len(U_CURVE_QUESTION) + len(U_CURVE_ANSWER) + 8
    keep = min(len(text), int(budget * chars_per_token) - extra)
    for _ in range(12):
        if keep <= 0:
            return None
        parts = _parts(text[:keep].strip(), U_CURVE_PARTS)
        if not parts:
            return None
        prompt = " ".join([parts[0], U_CURVE_NEEDLE, *parts[1:], U_CURVE_QUESTION])
        if count is None or count(prompt + U_CURVE_ANSWER) <= budget:
            break
        keep = int(keep * 0.85)
    else:
        return None
    segments: list[dict[str, Any]] = [{"name": "needle", "text": U_CURVE_NEEDLE}]
    at = len(parts[0]) + 1 + len(U_CURVE_NEEDLE) + 1
    for index, part in enumerate(parts):
        start = 0 if index == 0 else at
        occurrence, found = 0, -1
        while found < start:  # which occurrence of the part's text is this part (the text may repeat itself)
            found = prompt.find(part, found + 1)
            occurrence += 1
        segments.append({"name": f"part{index + 1}", "text": part, "occurrence": occurrence})
        if index:
            at += len(part) + 1
    return {"prompt": prompt, "segments": segments, "move": "needle", "answer": U_CURVE_ANSWER, "positions": 5}


def long_context_steps(
    text: str,
    model: str | None,
    tokens: int,
    *,
    threshold: int = LONG_CONTEXT_TOKENS,
    count: Callable[[str], int] | None = None,
    limit: int = U_CURVE_TOKENS,
) -> list[tuple[str, dict[str, Any]]] | str:
    """The (tool, arguments) of the long-context steps, or why there are none for this text (fewer than
    ``threshold`` tokens). ``count`` (the model's token count) and ``limit`` size the U-curve's prompt."""
    if tokens < threshold:
        return f"text has {tokens} tokens; the long-context steps need at least {threshold}"
    base: dict[str, Any] = {"detail": "full"} | ({"model": model} if model else {})
    window = min(KV_WINDOW, tokens // 4)
    steps: list[tuple[str, dict[str, Any]]] = [
        (
            "find_retrieval_heads",
            base
            | {"text": text, "lengths": [min(HAYSTACK_TOKENS, tokens)], "depths": RETRIEVAL_DEPTHS, "random_draws": 2},
        ),
        ("plan_kv_cache", base | {"text": text, "sink": KV_SINK, "window": window, "context_length": tokens}),
    ]
    u_curve = u_curve_arguments(text, tokens, count, limit=limit)
    if u_curve is not None:
        steps.append(("position_sensitivity", base | u_curve))
    return steps


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
            f"{len(report.heads)} heads score above 0; the best, {head_name(best.layer, best.head)}, scores "
            f"{best.score:.2f} ± {best.score_sd:.2f} (mean ± sd over the prompts)."
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


def u_curve_sentence(report: PositionSensitivityReport) -> str:
    """The U-curve in words: best and worst position of the needle, the spread, the shape."""
    from agent_tools.tools.position_sensitivity.narrative import where  # called once the report exists

    by_slot = {p.slot: p for p in report.positions}
    last = max(by_slot)
    best, worst = by_slot[report.best_slot], by_slot[report.worst_slot]
    shape = {
        "u_shaped": "a U-curve (both ends beat every middle position)",
        "flat": "flat (spread under 0.05 nats)",
        "other": "not a U-curve",
    }[report.shape]
    return (
        f"Moving the needle sentence through {len(by_slot)} positions among four parts of this text "
        f"({best.prompt_tokens} tokens), log p of {report.answer.strip()!r} is best {where(best.slot, last)} "
        f"(depth {best.relative_depth:.2f}, {best.answer_logprob:.3f} nats) and worst {where(worst.slot, last)} "
        f"(depth {worst.relative_depth:.2f}, {worst.answer_logprob:.3f} nats): spread {report.spread:.3f} nats, "
        f"{shape}."
    )


def long_context_sentences(
    retrieval: FindRetrievalHeadsReport | None,
    plan: PlanKvCacheReport | None,
    u_curve: PositionSensitivityReport | None,
) -> list[str]:
    """The section's sentences, each a function of the reports' numbers (empty when none ran); without a U-curve
    (``u_curve`` None) they say why there is none."""
    if retrieval is None and plan is None and u_curve is None:
        return []
    sentences = _retrieval_sentences(retrieval) if retrieval is not None else []
    if plan is not None:
        sentences.append(_plan_sentence(plan))
    sentences.append(NO_U_CURVE if u_curve is None else u_curve_sentence(u_curve))
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
