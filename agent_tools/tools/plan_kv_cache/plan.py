"""plan_kv_cache's passes: every KV head restricted on its own (one masked pass per layer group), the greedy plan,
and one verifying pass with every planned head restricted at once."""

from __future__ import annotations

import math
from collections.abc import Sequence

from agent_tools.analysis.long_context import (
    KV_PRECISION_BYTES,
    greedy_plan,
    kv_cache_bytes,
    short_cache_saving,
    verified_greedy,
)
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Inspector, check_indices
from agent_tools.long_context import all_restricted_losses, check_short_cache, short_cache_losses
from agent_tools.schemas import NextCall
from agent_tools.tools.plan_kv_cache.models import (
    KvHeadEffect,
    MemorySaving,
    PlanCheck,
    PlanKvCacheInput,
    PlanKvCacheReport,
    PlanStepRun,
)
from agent_tools.tools.plan_kv_cache.narrative import PlanNumbers, findings, summary

UNIT = (
    "KV head: a KV head can be served from the short cache only when every query head sharing it is, so the query "
    "heads of one KV head are restricted and planned together"
)
MIN_TOLERANCE = 1e-4  # nats: the default tolerance is half the budget, at least this (float noise is ~1e-6)


def max_runs(units: int) -> int:
    """Verifying runs the plan may use: halving a group down to one unit and doubling back, twice over."""
    return 4 + 2 * math.ceil(math.log2(units + 1))


def plan_kv_cache(inspector: Inspector, args: PlanKvCacheInput) -> PlanKvCacheReport:
    """Measure each KV head's loss change on a short cache, plan greedily under the budget, verify the plan."""
    if args.loss_budget < 0:
        msg = f"loss_budget {args.loss_budget} is negative; use a loss budget >= 0 nats (e.g. 0.02)"
        raise InvalidInputError(msg, field="loss_budget")
    if args.tolerance is not None and args.tolerance < 0:
        msg = f"tolerance {args.tolerance} is negative; use a tolerance >= 0 nats (omit it for half the loss budget)"
        raise InvalidInputError(msg, field="tolerance")
    loaded = inspector.model(args.model)
    facts = loaded.facts
    if not facts.is_language_model or facts.is_encoder_decoder:
        msg = f"plan_kv_cache needs a decoder-only causal LM (a next-token loss and a KV cache); {loaded.name!r} is not"
        raise InvalidInputError(msg, field="model")
    limit = inspector.limit_for(loaded)
    context = args.context_length if args.context_length is not None else limit
    if not 1 <= context <= limit:
        msg = f"context_length {context} is outside 1..{limit}, the tokens {loaded.name!r} takes here"
        raise ResourceLimitError(msg, field="context_length")
    encoded = inspector.encode(loaded, args.text)
    inspector.explains(loaded, encoded)  # its passes are masked ones: the report's path gap is this text's
    length = encoded.length
    scored = check_short_cache(length, args.sink, args.window)
    layers = sorted(check_indices(args.layers, facts.num_layers, "layers"))
    units = [(layer, tuple(facts.heads_sharing_kv(kv))) for layer in layers for kv in range(facts.num_kv_heads)]
    measured = short_cache_losses(inspector, loaded, encoded.input_ids, units, sink=args.sink, window=args.window)
    changes = (measured.rows - measured.clean_rows).double().mean(-1).tolist()  # over the scored predictions
    agreement = (measured.top == measured.clean_top[None]).double().mean(-1).tolist()
    additive = greedy_plan(changes, args.loss_budget)
    loss_full = float(measured.clean.double().mean())

    def verify(picked: Sequence[int]) -> tuple[float, float]:
        """(loss change, top-token agreement) with the ``picked`` units restricted at once, one row: the
        unrestricted losses are the measuring passes' row 0."""
        restricted = [units[i] for i in sorted(picked)]
        losses, top = all_restricted_losses(
            loaded, encoded.input_ids, restricted, sink=args.sink, window=args.window, clean_row=False
        )
        change = float((losses[0] - measured.clean).double().mean())
        return change, float((top[0] == measured.clean_top).double().mean())

    tolerance = args.tolerance if args.tolerance is not None else max(args.loss_budget / 2, MIN_TOLERANCE)
    built = verified_greedy(changes, args.loss_budget, tolerance, verify, max_runs=max_runs(len(units)))
    first = built.steps[0] if built.steps else None
    additive_verified = first.verified if first is not None and len(first.added) == len(additive.chosen) else 0.0
    chosen = set(built.chosen)
    per_number = KV_PRECISION_BYTES[args.precision]
    full = kv_cache_bytes(
        layers=facts.num_layers,
        kv_heads=facts.num_kv_heads,
        head_dim=facts.head_dim,
        tokens=context,
        bytes_per_number=per_number,
    )
    saved = short_cache_saving(
        planned_kv_heads=len(chosen),
        head_dim=facts.head_dim,
        tokens=context,
        cache_tokens=args.sink + args.window,
        bytes_per_number=per_number,
    )
    heads = [
        KvHeadEffect(
            layer=layer,
            kv_head=index % facts.num_kv_heads,
            query_heads=list(query_heads),
            loss_change=changes[index],
            top_token_agreement=agreement[index],
            planned=index in chosen,
        )
        for index, (layer, query_heads) in enumerate(units)
    ]
    ranked = sorted(range(len(units)), key=lambda i: -changes[i])
    numbers = PlanNumbers(
        tokens=length,
        sink=args.sink,
        window=args.window,
        loss_budget=args.loss_budget,
        planned_kv_heads=len(chosen),
        total_kv_heads=facts.num_layers * facts.num_kv_heads,
        predicted_loss_change=built.predicted,
        verified_loss_change=built.verified,
        verified_top_token_agreement=built.agreement,
        context_length=context,
        precision=args.precision,
        saved_bytes=saved,
        saved_fraction=saved / full if full else 0.0,
        additive_kv_heads=len(additive.chosen),
        additive_verified_loss_change=additive_verified,
        additive_loss_change=built.additive,
        tolerance=tolerance,
        runs=len(built.steps),
        needs_full=[(_label(units[i][0], i % facts.num_kv_heads), changes[i]) for i in ranked[:3]],
    )
    steps = [
        PlanStepRun(
            added_kv_heads=len(step.added),
            predicted_loss_change=step.predicted,
            verified_loss_change=step.verified,
            accepted=step.accepted,
        )
        for step in built.steps
    ]
    measured_numbers = vars(numbers)  # the plan and memory rows take theirs by name
    return PlanKvCacheReport(
        model=loaded.name,
        summary=summary(numbers),
        findings=findings(numbers),
        tokens=length,
        sink=args.sink,
        window=args.window,
        scored_positions=scored,
        unit=UNIT,
        loss_budget=args.loss_budget,
        layers=layers,
        heads=heads,
        plan=PlanCheck.model_validate(
            measured_numbers | {"loss_full": loss_full, "loss_planned": loss_full + built.verified, "steps": steps}
        ),
        memory=MemorySaving.model_validate(
            measured_numbers | {"full_kv_bytes": full, "planned_kv_bytes": full - saved}
        ),
        masked_passes=measured.passes + len(built.steps),
        measured_on=(
            f"this text ({length} tokens; {scored} predictions past sink + window scored): the plan holds for texts "
            "like it, not in general"
        ),
        next_calls=_next_calls(loaded.name, args, units, ranked, facts.num_kv_heads),
    )


def _label(layer: int, kv_head: int) -> str:
    return f"L{layer}KV{kv_head}"


def _next_calls(
    model: str, args: PlanKvCacheInput, units: list[tuple[int, tuple[int, ...]]], ranked: list[int], kv_heads: int
) -> list[NextCall]:
    """Remove the KV head that needs the full cache most (does the model depend on it at all?)."""
    layer, query_heads = units[ranked[0]]
    return [
        NextCall(
            tool="ablate_heads",
            arguments={"model": model, "text": args.text, "heads": [f"{layer}.{h}" for h in query_heads]},
            why=f"KV head {_label(layer, ranked[0] % kv_heads)} needs the full cache most; removing its query heads "
            "shows how much the model relies on what they read",
        )
    ]
