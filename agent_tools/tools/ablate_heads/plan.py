"""ablate_heads' pass: clean and ablated forwards through the inspector, then the effect sizes on the output."""

from __future__ import annotations

import torch

from agent_tools.ablation_check import (
    ResampleSource,
    baseline_of,
    measure_head_sets,
    random_sets,
    resample_source,
    stepped_kl,
    stepped_losses,
)
from agent_tools.analysis.ablation import compare_with_baseline, cosine_change, size_against
from agent_tools.analysis.attribution_patching import top_token_change
from agent_tools.analysis.metrics import Baseline
from agent_tools.clean_corrupted import single_token
from agent_tools.encoding import decode
from agent_tools.errors import InvalidInputError, UnsupportedModelError
from agent_tools.inspector import Encoded, Inspector
from agent_tools.loading import LoadedModel
from agent_tools.runner import AblationEffect
from agent_tools.runner.attribution import direct_logits
from agent_tools.schemas import NextCall, head_label
from agent_tools.session import guarded
from agent_tools.stack_input import on_stack
from agent_tools.tools.ablate_heads.models import (
    AblateHeadsInput,
    AblationBaseline,
    AblationReport,
    DirectLogitAttribution,
    HeadLogit,
    PositionEffect,
    parse_heads,
)
from agent_tools.tools.ablate_heads.narrative import (
    BEYOND_RULE,
    Ablated,
    EmbeddingEffect,
    dla_finding,
    dla_summary,
    embedding_baseline_text,
    embedding_summary,
    next_token_summary,
    position_findings,
)

DLA_HEADS_SHOWN = 5
DLA_METHOD = (
    "each head's output z_h through its slice of W_O, then the final norm with its scale σ frozen at the clean run's "
    "value (so it is linear), then the unembedding row of the token, less the unembedding of 0; every module runs "
    "its own forward on these extra rows. Heads' numbers add up; they say what a head writes directly into the "
    "logit (before any final soft-capping), not what removing it does (later layers may compensate: compare the "
    "ablation above)"
)


STACK_REFUSAL = (
    "ablate_heads removes heads of one stack and measures the change in what that stack's pass outputs; on an "
    "encoder–decoder it ablates encoder heads and measures the encoder's output (decoder and cross-attention "
    "heads are not ablated by this tool)"
)


def ablate_heads(inspector: Inspector, args: AblateHeadsInput) -> AblationReport:
    """Remove the named heads' contribution and report how the model's output changes on the text."""
    loaded = inspector.model(args.model)
    stack = inspector.attention_stack(loaded, args.attention)
    inspector.require_stack(loaded, stack, ("self", "encoder"), STACK_REFUSAL)
    heads = parse_heads(args.heads, stack.num_layers, stack.num_heads)
    encoded = inspector.encode(loaded, args.text)
    target = _target_token(loaded, args.target_token)
    resample = _resample(inspector, loaded, encoded, args)
    effect = inspector.ablate(
        loaded,
        encoded.input_ids,
        encoded.attention_mask,
        heads,
        method=args.method,
        resample_ids=resample.ids if resample is not None else None,
    )
    pool = [(layer, head) for layer in range(stack.num_layers) for head in range(stack.num_heads)]
    drawn, note = random_sets([h for h in pool if h not in set(heads)], len(heads), args.baseline_draws, seed=args.seed)
    measured = measure_head_sets(inspector, loaded, encoded, [(s, args.method) for s in drawn], resample)
    ablated = Ablated(
        heads=[head_label(layer, head) for layer, head in heads],
        method=args.method,
        tokens=encoded.length,
        resample_source=resample.description if resample is not None else None,
    )
    notes = [note] if note else []
    if not effect.language_model:
        report = _embedding_report(loaded, encoded, effect, ablated, args)
        baseline = _baseline(report.pooled_cosine_change or 0.0, None, measured.effects, len(heads))
        summary = report.summary + embedding_baseline_text(baseline)
        said = on_stack(stack.name, summary)
        return report.model_copy(
            update={"attention": stack.name, "summary": said, "baseline": baseline, "notes": notes}
        )
    report = _next_token_report(loaded, encoded, effect, ablated, args)
    baseline = _baseline(report.loss_change or 0.0, report.kl_mean, measured.effects, len(heads))
    report = report.model_copy(
        update={
            "summary": next_token_summary(ablated, report, baseline),
            "baseline": baseline,
            "notes": notes,
            "resample_source": ablated.resample_source,
        }
    )
    token = target if target is not None else int(effect.clean[0, -1].argmax())
    try:
        dla = _direct_logits(inspector, loaded, encoded, token, heads)
    except UnsupportedModelError as exc:
        if args.target_token is not None:
            raise
        return report.model_copy(update={"notes": [*notes, f"direct logit attribution skipped: {exc.message}"]})
    return report.model_copy(
        update={
            "summary": report.summary + dla_summary(dla),
            "findings": [*report.findings, dla_finding(dla)],
            "direct_logit_attribution": dla,
            "next_calls": _next_calls(loaded, args, heads, dla),
        }
    )


def _resample(
    inspector: Inspector, loaded: LoadedModel, encoded: Encoded, args: AblateHeadsInput
) -> ResampleSource | None:
    """method resample: resample_text's first T tokens, else the text's own tokens shuffled (seeded, said in the
    report); an error when neither exists. resample_text with another method is refused (it would do nothing)."""
    if args.method != "resample":
        if args.resample_text is not None:
            msg = f"resample_text is used only with method 'resample' (method is {args.method!r})"
            raise InvalidInputError(msg, field="resample_text")
        return None
    source = resample_source(inspector, loaded, encoded, args.resample_text, seed=args.seed)
    if source.ids is None:
        raise InvalidInputError(f"method resample: {source.description}", field="resample_text")
    return source


def _baseline(effect: float, kl: float | None, draws: list, count: int) -> AblationBaseline | None:
    """The named heads' effect (and KL) against the random draws' (None without draws)."""
    if not draws:
        return None
    effects = baseline_of(draws)
    kls = Baseline(tuple(d.kl_mean for d in draws)) if kl is not None else None
    return AblationBaseline(
        draws=len(draws),
        heads_per_draw=count,
        effect=(effects.mean, effects.spread),
        kl_mean=(kls.mean, kls.spread) if kls is not None else None,
        effect_direction=compare_with_baseline(effect, effects),
        kl_size=size_against(kl, kls) if kls is not None and kl is not None else None,
        rule=BEYOND_RULE,
    )


def _target_token(loaded: LoadedModel, text: str | None) -> int | None:
    """The one token id of ``target_token`` (None: not given), or an error naming the tokens it splits into."""
    if text is None:
        return None
    if not loaded.facts.is_language_model:
        msg = f"target_token needs a causal LM; {loaded.name!r} has no next-token head"
        raise InvalidInputError(msg, field="target_token")
    return single_token(loaded, text, "target_token")


def _direct_logits(
    inspector: Inspector, loaded: LoadedModel, encoded: Encoded, token: int, heads: list[tuple[int, int]]
) -> DirectLogitAttribution:
    """Every head's direct logit attribution to ``token`` at the last position, as the report states it."""
    with guarded(loaded):
        found = direct_logits(loaded, encoded.input_ids, token)
    grid = found.heads  # (L, H)

    def row(layer: int, head: int) -> HeadLogit:
        return HeadLogit(layer=layer, head=head, logit=float(grid[layer, head]))

    order = grid.abs().flatten().argsort(descending=True)[:DLA_HEADS_SHOWN].tolist()
    return DirectLogitAttribution(
        token=decode(loaded, [token]),
        token_id=token,
        logit=found.logit,
        heads_total=float(grid.sum()),
        final_norm=found.norm,
        frozen_scale=found.scale,
        method=DLA_METHOD,
        ablated=[row(layer, head) for layer, head in heads],
        top_heads=[row(*divmod(int(i), grid.shape[1])) for i in order],
        layers=grid.sum(1).tolist(),
    )


def _next_calls(
    loaded: LoadedModel, args: AblateHeadsInput, heads: list[tuple[int, int]], dla: DirectLogitAttribution
) -> list[NextCall]:
    """Profile the ablated heads' layers; ablate the head that writes most into the logit when it was not ablated."""
    calls = [
        NextCall(
            tool="profile_heads",
            arguments={"model": loaded.name, "text": args.text, "layers": sorted({layer for layer, _ in heads})},
            why="what the ablated heads do (role scores with ablation evidence), to explain the effect measured here",
        )
    ]
    top = dla.top_heads[0]
    if (top.layer, top.head) not in heads:
        calls.append(
            NextCall(
                tool="ablate_heads",
                arguments={"model": loaded.name, "text": args.text, "heads": [head_label(top.layer, top.head)]},
                why=f"L{top.layer}H{top.head} writes most directly into {dla.token!r} ({top.logit:+.3f}); removing it "
                "shows whether the model depends on that write",
            )
        )
    return calls


def _largest(per_position: torch.Tensor, encoded: Encoded, top_k: int) -> tuple[list[float], list[PositionEffect]]:
    """The (T,) per-position effects as floats, and the ``top_k`` largest as the report states them, largest first."""
    values: list[float] = per_position.tolist()
    order: list[int] = per_position.argsort(descending=True)[:top_k].tolist()
    return values, [PositionEffect(position=p, token=encoded.tokens[p].text, value=values[p]) for p in order]


def _next_token_effect(
    loaded: LoadedModel, encoded: Encoded, effect: AblationEffect, kl_values: list[float]
) -> dict[str, object]:
    """The report's KL summary (per-position ``kl_values``), the top next token clean vs ablated, and the loss on the
    text."""
    clean_probs = torch.softmax(effect.clean[0, -1].double(), -1)  # (V,)
    change = top_token_change(effect.clean[0, -1], effect.ablated[0, -1])
    measured: dict[str, object] = {}
    if encoded.length > 1:
        loss_clean = float(stepped_losses(effect.clean, encoded.input_ids).mean())
        loss_ablated = float(stepped_losses(effect.ablated, encoded.input_ids).mean())
        measured = {"loss_clean": loss_clean, "loss_ablated": loss_ablated, "loss_change": loss_ablated - loss_clean}
    return measured | {
        "kl_last_position": kl_values[-1],
        "kl_mean": sum(kl_values) / len(kl_values),
        "top_token_clean": decode(loaded, [change.before]),
        "top_token_ablated": decode(loaded, [change.after]),
        "top_token_changed": change.kind != "unchanged",
        "top_token_change": "same" if change.kind == "unchanged" else change.kind,
        "top_token_probability_clean": float(clean_probs[change.before]),
        "top_token_probability_ablated": change.p_before,
        "top_token_probability_new": change.p_after,
    }


def _next_token_report(
    loaded: LoadedModel, encoded: Encoded, effect: AblationEffect, ablated: Ablated, args: AblateHeadsInput
) -> AblationReport:
    """A causal LM's report: KL of the next-token distribution, loss on the text, top next token (its summary is
    written from these numbers once the baseline is known)."""
    kl_values, largest = _largest(stepped_kl(effect.clean[0], effect.ablated[0]), encoded, args.top_k)  # (T,)
    return AblationReport.model_validate(
        {
            "model": loaded.name,
            "summary": "",
            "findings": position_findings(largest, embedding=False),
            "heads": list(ablated.heads),
            "method": args.method,
            "measure": "next_token",
            "tokens": encoded.length,
            "largest_effects": largest,
        }
        | _next_token_effect(loaded, encoded, effect, kl_values)
    )


def _embedding_report(
    loaded: LoadedModel, encoded: Encoded, effect: AblationEffect, ablated: Ablated, args: AblateHeadsInput
) -> AblationReport:
    """An encoder's report: how far the pooled and the per-token output embeddings turn (1 − cos)."""
    values, largest = _largest(cosine_change(effect.clean[0], effect.ablated[0]), encoded, args.top_k)  # (T,)
    peak = largest[0].position
    numbers = EmbeddingEffect(
        pooled=float(cosine_change(effect.clean[0].mean(0), effect.ablated[0].mean(0))),
        mean=sum(values) / len(values),
        peak_position=peak,
        peak_token=encoded.tokens[peak].text,
        peak=values[peak],
    )
    return AblationReport(
        model=loaded.name,
        summary=embedding_summary(ablated, numbers),
        findings=position_findings(largest, embedding=True),
        heads=list(ablated.heads),
        method=args.method,
        measure="embedding",
        tokens=encoded.length,
        pooled_cosine_change=numbers.pooled,
        mean_token_cosine_change=numbers.mean,
        largest_effects=largest,
    )
