"""patch_heads' passes: a recorded clean run, the corrupted run, then batched patched runs of the corrupted prompt.

Every head's (and every layer's) patch is one row of a batch; rows are grouped by layer, so the layers before the
patched one run once per group (:mod:`agent_tools.runner.patching`). The top heads are then patched one position at
a time, from the first position where the prompts differ (before it the clean and corrupted head outputs are the
same, so a patch there restores exactly nothing). Every forward goes through the inspector.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from agent_tools.analysis.attribution_patching import (
    MIN_RELATIVE_GAP,
    TIE_MARGIN,
    effect_size,
    minimum_gap,
    top_token_read,
    verify,
)
from agent_tools.analysis.metrics import Baseline as Draws
from agent_tools.clean_corrupted import LogitDifference, answer_ids, encode_pair, first_difference, restored
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Encoded, Inspector
from agent_tools.loading import LoadedModel
from agent_tools.runner.attribution_patching import AttributionPasses, mlp_patched_logits
from agent_tools.runner.patching import HeadPatch, recorded_run
from agent_tools.runner.readout import LastPosition, last_position
from agent_tools.schemas import NextCall, head_label, rounded
from agent_tools.session import guarded
from agent_tools.tools.patch_heads.models import (
    AUTO_ATTRIBUTION_ABOVE,
    AttributionCheck,
    Baseline,
    HeadPatchResult,
    HeadPositions,
    LayerEstimate,
    LayerPatchResult,
    PatchHeadsInput,
    PatchReport,
    PositionPatch,
    SetPatch,
)
from agent_tools.tools.patch_heads.narrative import Patched, findings, summary

MIN_LOGIT_GAP = 1e-4  # clean and corrupted logit differences closer than this leave nothing to restore


@dataclass(frozen=True)
class _Pair:
    """The two prompts, where they first differ, the answer tokens and the logit differences to restore."""

    clean: Encoded
    corrupted: Encoded
    first: int
    answer: int
    wrong: int
    ld_clean: float
    ld_corrupted: float
    gap_threshold: float
    sources: dict[int, torch.Tensor]  # the clean run's head outputs, layer -> (T, H, D)
    corrupted_logits: torch.Tensor  # (V,) the corrupted run's next-token logits
    estimates: torch.Tensor | None = None  # attribution: (L, T, H) estimated restored fraction per position

    @property
    def readout(self) -> LastPosition:
        """What a patched row keeps: the answer's, the wrong token's and the corrupted run's top token's logits,
        the log-sum-exp and the top token at the last position (:mod:`agent_tools.runner.readout`)."""
        return last_position((self.answer, self.wrong, int(self.corrupted_logits.argmax())))

    def restored(self, read: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """What :attr:`readout` kept of R patched rows -> (R,) restored fractions, (R,) logit differences."""
        return restored(read[0], self.ld_clean, self.ld_corrupted)


def _pair(
    loaded: LoadedModel,
    args: PatchHeadsInput,
    prompts: tuple[Encoded, Encoded],
    logits: tuple[torch.Tensor, torch.Tensor],
    sources: dict[int, torch.Tensor],
) -> _Pair:
    """The answer tokens and logit differences of both runs ((V,) logits each); refuse a gap too small to divide by."""
    clean, corrupted = prompts
    answer, wrong = answer_ids(loaded, args.answer, args.wrong, logits[0], logits[1])
    ld_clean = float(logits[0][answer] - logits[0][wrong])
    ld_corrupted = float(logits[1][answer] - logits[1][wrong])
    threshold = max(MIN_LOGIT_GAP, minimum_gap(logits[0]))
    if abs(ld_clean - ld_corrupted) < threshold:
        msg = (
            f"clean and corrupted give logit differences {ld_clean:.4g} and {ld_corrupted:.4g} between the two "
            f"answers, {abs(ld_clean - ld_corrupted):.3g} apart: below {threshold:.3g} ({MIN_RELATIVE_GAP} × the "
            "standard deviation of the clean next-token logits), too small to state fractions of — nothing to "
            "restore; corrupt the information the answer depends on, or choose answer/wrong tokens that differ"
        )
        raise InvalidInputError(msg, field="corrupted")
    return _Pair(
        clean,
        corrupted,
        first_difference(*prompts),
        answer,
        wrong,
        ld_clean,
        ld_corrupted,
        threshold,
        sources,
        logits[1],
    )


def _exact_pair(loaded: LoadedModel, args: PatchHeadsInput, prompts: tuple) -> _Pair:
    """Run both prompts (recording the clean head outputs) and build the pair."""
    with guarded(loaded):
        recorded = recorded_run(loaded, prompts[0].input_ids)
        corrupted_logits = recorded_run(loaded, prompts[1].input_ids).output
    return _pair(loaded, args, prompts, (recorded.output[-1], corrupted_logits[-1]), recorded.heads)


STACK_REFUSAL = (
    "patch_heads copies head outputs between two runs of a decoder-only language model and reads the next-token "
    "logits; an encoder–decoder's logits come from its decoder reading the encoder, which this tool does not patch"
)
SET_DRAWS = 8  # random head sets the top set is compared with
SAMPLE_OUTSIDE = 10  # attribution: heads drawn at random outside the candidates and patched exactly (at most)
SEED = 0  # every random draw is seeded: the same call gives the same baseline


def _method(loaded: LoadedModel, args: PatchHeadsInput, layers: list[int], span: int) -> str:
    """exact or attribution; auto picks attribution when heads × positions after the first difference exceed
    :data:`AUTO_ATTRIBUTION_ABOVE`."""
    if args.method != "auto":
        return args.method
    return "attribution" if len(layers) * loaded.facts.num_heads * span > AUTO_ATTRIBUTION_ABOVE else "exact"


def patch_heads(inspector: Inspector, args: PatchHeadsInput) -> PatchReport:
    """Patch every head's clean output into the corrupted run (or estimate every head by attribution patching and
    patch the candidates exactly); size the top heads against random heads patched the same way."""
    loaded = inspector.model(args.model)
    stack = inspector.attention_stack(loaded, args.attention)
    inspector.require_stack(loaded, stack, ("self",), STACK_REFUSAL)
    if not loaded.facts.is_language_model:
        raise InvalidInputError(f"model {loaded.name!r} has no next-token head; patch_heads needs a language model")
    layers = inspector.check_layers(loaded, args.layers, stack, "layers")
    prompts = encode_pair(inspector, loaded, args.clean, args.corrupted)
    method = _method(loaded, args, layers, prompts[0].length - first_difference(*prompts))
    attribution = None
    if method == "attribution":
        pair, head_rows, layer_rows, attribution, sample = _attribution(inspector, loaded, args, prompts, layers)
    else:
        pair = _exact_pair(loaded, args, prompts)
        every = [(layer, head) for layer in layers for head in range(loaded.facts.num_heads)]
        head_rows, layer_rows = _patch_heads_exactly(inspector, loaded, pair, every, layers)
        sample = head_rows
    if attribution is not None:
        exact = {row.layer: row.restored for row in layer_rows}
        estimated = [r.model_copy(update={"attention_exact": exact.get(r.layer)}) for r in attribution.layers]
        attribution = attribution.model_copy(update={"layers": estimated})
    ranked = sorted(head_rows, key=lambda r: -abs(r.restored))
    chosen = {(r.layer, r.head) for r in ranked[: args.top_k]}
    single, drawn = _baseline([r.restored for r in sample if (r.layer, r.head) not in chosen], 1)
    top = [r.model_copy(update={"size": effect_size(r.restored, drawn)}) for r in ranked[: args.top_k]]
    top_set = _top_set(inspector, loaded, pair, layers, top)
    positions = _positions(inspector, loaded, pair, top) if args.per_position else []
    differing = (pair.clean.input_ids[0] != pair.corrupted.input_ids[0]).nonzero().flatten().tolist()
    set_rows = (1 + SET_DRAWS) if top_set is not None else 0
    mlp_rows = sum(r.mlp_exact is not None for r in attribution.layers) if attribution is not None else 0
    report = PatchReport(
        model=loaded.name,
        summary="",
        findings=[],
        tokens=pair.clean.length,
        first_difference=pair.first,
        differing_positions=differing,
        answer=str(loaded.tokenizer.decode([pair.answer])),
        answer_id=pair.answer,
        wrong=str(loaded.tokenizer.decode([pair.wrong])),
        wrong_id=pair.wrong,
        logit_difference_clean=pair.ld_clean,
        logit_difference_corrupted=pair.ld_corrupted,
        gap_threshold=pair.gap_threshold,
        method="attribution" if attribution is not None else "exact",
        single_head_baseline=single,
        top_set=top_set,
        tie_margin=TIE_MARGIN,
        direction="the clean run's head outputs copied into the corrupted run (denoising)",
        layers=layers,
        top_heads=top,
        heads=head_rows,
        layer_results=layer_rows,
        positions=positions,
        attribution=attribution,
        patched_runs=len(head_rows)
        + len(layer_rows)
        + set_rows
        + mlp_rows
        + len(top) * (pair.clean.length - pair.first) * bool(positions),
        next_calls=_next_calls(loaded, args, top),
    )
    numbers = Patched(report, pair.ld_clean, pair.ld_corrupted, heads=len(layers) * loaded.facts.num_heads)
    return report.model_copy(update={"summary": summary(numbers), "findings": findings(numbers)})


def _baseline(values: list[float], size: int) -> tuple[Baseline, Draws]:
    """The draws' restored fractions as the report's baseline row and as the baseline effects are sized against;
    an empty pool counts as one zero (no spread, 0 draws reported)."""
    drawn = Draws(tuple(values or [0.0]))
    return Baseline(mean=drawn.mean, spread=drawn.spread, draws=len(values), heads=size), drawn


def _patch_heads_exactly(
    inspector: Inspector, loaded: LoadedModel, pair: _Pair, heads: list[tuple[int, int]], layers: list[int]
) -> tuple[list[HeadPatchResult], list[LayerPatchResult]]:
    """The given heads patched alone (in the given order) and every layer's heads together (its whole attention
    output): one row each of the same batched forwards."""
    single = [HeadPatch(layer, (head,)) for layer, head in heads]
    whole = [HeadPatch(layer, tuple(range(loaded.facts.num_heads))) for layer in layers]
    patches = single + whole
    outputs = inspector.patched_outputs(
        loaded, pair.corrupted, patches, readout=pair.readout, sources=pair.sources, prefix=pair.first
    )
    fractions, differences = (values.tolist() for values in pair.restored(outputs))
    head_rows = [
        HeadPatchResult(layer=p.layer, head=p.heads[0], restored=f, logit_difference=d)
        for p, f, d in zip(single, fractions, differences, strict=False)
    ]
    layer_rows = [
        LayerPatchResult(layer=p.layer, restored=f) for p, f in zip(whole, fractions[len(single) :], strict=True)
    ]
    return head_rows, layer_rows


def _top_set(
    inspector: Inspector, loaded: LoadedModel, pair: _Pair, layers: list[int], top: list[HeadPatchResult]
) -> SetPatch | None:
    """The top heads patched together, and :data:`SET_DRAWS` random sets of as many heads from the rest (None
    when the rest has fewer heads than the set)."""
    chosen = [(r.layer, r.head) for r in top]
    pool = [(layer, head) for layer in layers for head in range(loaded.facts.num_heads) if (layer, head) not in chosen]
    if len(pool) < len(chosen):
        return None
    generator = random.Random(SEED)
    draws = [generator.sample(pool, len(chosen)) for _ in range(SET_DRAWS)]
    patches = [HeadPatch.together(chosen)] + [HeadPatch.together(draw) for draw in draws]
    outputs = inspector.patched_outputs(
        loaded, pair.corrupted, patches, readout=pair.readout, sources=pair.sources, prefix=pair.first
    )
    fractions, _ = pair.restored(outputs)
    values = fractions.tolist()
    reference, drawn = _baseline(values[1:], len(chosen))
    chosen_logits, normaliser, top_logit, top_token = (t[0] for t in outputs)  # the top set's row is row 0
    logits = torch.stack([chosen_logits[2], top_logit]).cpu().double()  # the corrupted run's top token, the new top
    p_before, p_after = (logits - float(normaliser)).exp().tolist()
    change = top_token_read(int(pair.corrupted_logits.argmax()), int(top_token), p_before, p_after)
    decode = loaded.tokenizer.decode
    return SetPatch(
        heads=[head_label(layer, head) for layer, head in chosen],
        restored=values[0],
        baseline=reference,
        size=effect_size(values[0], drawn),
        top_token_corrupted=str(decode([change.before])),
        top_token_patched=str(decode([change.after])),
        change=change.kind,
        p_old=change.p_before,
        p_new=change.p_after,
    )


MLPS_VERIFIED = 3  # attribution: the MLP outputs with the largest |estimate| patched exactly


def _layer_estimates(
    inspector: Inspector, loaded: LoadedModel, pair: _Pair, passes: AttributionPasses, layers: list[int]
) -> list[LayerEstimate]:
    """Each layer's attention-output estimate (its exact value is filled in from the whole-layer patches), and the
    MLP estimate beside the exact value for the :data:`MLPS_VERIFIED` largest (no MLP estimate is shown alone)."""
    gap = pair.ld_clean - pair.ld_corrupted
    mlp = {layer: float(passes.mlp[layer].sum()) for layer in layers if layer in passes.clean_mlp}
    chosen = sorted(mlp, key=lambda layer: -abs(mlp[layer]))[:MLPS_VERIFIED]
    exact: dict[int, float] = {}
    if chosen:
        sources = {layer: passes.clean_mlp[layer] for layer in chosen}  # layer -> (T, C) clean MLP output
        with guarded(loaded):
            logits = mlp_patched_logits(loaded, pair.corrupted.input_ids, sources)
        fractions, _ = pair.restored(pair.readout(logits[:, None]))
        exact = dict(zip(chosen, fractions.tolist(), strict=True))
    return [
        LayerEstimate(
            layer=layer,
            attention_estimate=float(passes.heads[layer].sum()) / gap,
            mlp_estimate=mlp[layer] / gap if layer in exact else None,
            mlp_exact=exact.get(layer),
        )
        for layer in layers
    ]


def _attribution(
    inspector: Inspector, loaded: LoadedModel, args: PatchHeadsInput, prompts: tuple, layers: list[int]
) -> tuple[_Pair, list[HeadPatchResult], list[LayerPatchResult], AttributionCheck, list[HeadPatchResult]]:
    """Estimate every head by attribution patching, patch the candidates and a random sample outside them exactly.

    Returns the pair, the exactly patched heads (candidates first, each with its estimate beside), the check, and
    the random sample's rows (the single-head baseline)."""
    metric = LogitDifference(loaded, args.answer, args.wrong)
    passes = inspector.attribution_passes(
        loaded, prompts[0], prompts[1], metric, grad_drop=args.grad_drop, saturation_fix=args.saturation_fix
    )
    pair = _pair(loaded, args, prompts, (passes.clean_logits, passes.corrupted_logits), passes.clean_heads)
    gap = pair.ld_clean - pair.ld_corrupted
    pair = replace(pair, estimates=passes.heads / gap)
    per_head = passes.heads.sum(1)  # (L, H) estimated Δ LD
    heads = [(layer, head) for layer in layers for head in range(loaded.facts.num_heads)]
    by_estimate = sorted(heads, key=lambda x: -abs(float(per_head[x])))
    candidates = by_estimate[: args.verify]
    if passes.grad_drop is not None:
        extra = sorted(heads, key=lambda x: -float(passes.grad_drop[x]))  # type: ignore[index]
        candidates += [x for x in extra if x not in candidates][: max(1, args.verify // 2)]
    outside = [x for x in heads if x not in candidates]
    sample = random.Random(SEED).sample(outside, min(len(outside), SAMPLE_OUTSIDE, args.verify))
    rows, layer_rows = _patch_heads_exactly(inspector, loaded, pair, candidates + sample, layers)
    rows = [
        HeadPatchResult.model_validate(r.model_dump() | {"estimate": float(per_head[r.layer, r.head]) / gap})
        for r in rows
    ]
    estimates = [float(per_head[r.layer, r.head]) for r in rows]
    exact = [r.restored for r in rows]
    k = min(args.top_k, len(candidates))
    top_estimated = sorted(range(len(rows)), key=lambda i: -abs(estimates[i]))[:k]
    checked = verify(estimates, exact, top_estimated, k)
    outside_rows = [rows[i] for i in range(len(candidates), len(rows))]
    missed = max(outside_rows, key=lambda r: abs(r.restored)) if outside_rows else None
    check = AttributionCheck(
        estimated=len(heads),
        verified_top=len(candidates),
        verified_random=len(sample),
        spearman=checked.spearman,
        recall=checked.recall,
        k=k,
        missed=missed,
        grad_drop=passes.grad_drop is not None,
        saturated=_saturated_labels(passes.saturated, layers),
        gradient_dtype=passes.gradient_dtype,
        layers=_layer_estimates(inspector, loaded, pair, passes, layers),
        forward_equivalents=rounded(1 + 3 * passes.rows, 1),
    )
    return pair, rows, layer_rows, check, outside_rows


def _saturated_labels(saturated: dict[int, list[int]] | None, layers: list[int]) -> list[str] | None:
    """The heads AtP* corrected, among the layers asked for (None when the fix was off)."""
    if saturated is None:
        return None
    return [head_label(layer, head) for layer in layers for head in saturated.get(layer, [])]


def _positions(inspector: Inspector, loaded: LoadedModel, pair: _Pair, top: list[HeadPatchResult]) -> list:
    """Each top head patched at one position at a time, from the first differing position on (one batch)."""
    corrupted, first = pair.corrupted, pair.first
    span = range(first, corrupted.length)
    patches = [HeadPatch(r.layer, (r.head,), (p,)) for r in top for p in span]
    outputs = inspector.patched_outputs(
        loaded, corrupted, patches, readout=pair.readout, sources=pair.sources, prefix=first
    )
    fractions = pair.restored(outputs)[0].reshape(len(top), len(span)).tolist()  # one copy for every row
    estimates = (
        pair.estimates[[r.layer for r in top], :, [r.head for r in top]].tolist()  # (top, T): one copy
        if pair.estimates is not None
        else None
    )
    return [
        HeadPositions(
            layer=r.layer,
            head=r.head,
            positions=[
                PositionPatch(
                    position=p,
                    token=corrupted.tokens[p].text,
                    restored=fractions[k][p - first] if p >= first else 0.0,
                    estimate=estimates[k][p] if estimates is not None else None,
                )
                for p in range(corrupted.length)
            ],
        )
        for k, r in enumerate(top)
    ]


def _next_calls(loaded: LoadedModel, args: PatchHeadsInput, top: list[HeadPatchResult]) -> list[NextCall]:
    """Ablate the top heads on the clean prompt (do they matter there?) and profile their layers (what are they?)."""
    labels = [head_label(r.layer, r.head) for r in top]
    layers = sorted({r.layer for r in top})
    return [
        NextCall(
            tool="ablate_heads",
            arguments={"model": loaded.name, "text": args.clean, "heads": labels},
            why="removing the heads that restore most should break the clean answer if they carry it; the report "
            "also gives each head's direct logit attribution",
        ),
        NextCall(
            tool="profile_heads",
            arguments={"model": loaded.name, "text": args.clean, "layers": layers},
            why="the roles of the top heads (previous-token, induction, ...) with ablation evidence",
        ),
    ]
