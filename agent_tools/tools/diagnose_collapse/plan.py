"""diagnose_collapse's pass: one :class:`CollapseConsumer` over the requested layers, then the report built from it.

The pass is declared as a :class:`PassPlan` so the ``analyze`` job can stream it together with other tools'
consumers from one forward pass; run alone, the tool hands the same plan to
``inspector.execute``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, replace

from agent_tools.ablation_check import (
    HeadSet,
    baseline_of,
    measure_head_sets,
    random_sets,
    resample_source,
)
from agent_tools.analysis.ablation import compare_with_baseline
from agent_tools.analysis.collapse import COLLAPSED_VERDICTS, HeadCollapse, collapse_kind, rank_heads
from agent_tools.analysis.metrics import Baseline, sink_key_mask
from agent_tools.consumers.collapse import CollapseConsumer, output_grams_for
from agent_tools.families import StackFacts
from agent_tools.inspector import Encoded, Inspector, PassPlan, text_digest
from agent_tools.intervene import AblationMethod
from agent_tools.loading import LoadedModel
from agent_tools.render import GridStyle, grid_heatmap
from agent_tools.schemas import Token, head_label
from agent_tools.stack_input import on_stack
from agent_tools.tools.diagnose_collapse import narrative
from agent_tools.tools.diagnose_collapse.models import (
    BEYOND_RULE,
    AblationEffectRow,
    BaselineRow,
    CollapseCheck,
    CollapseCheckRow,
    CollapseReport,
    DiagnoseCollapseInput,
    GroupCheckRow,
    HeadCollapseRow,
)
from agent_tools.tools.diagnose_collapse.narrative import CollapseNumbers


def plan_diagnose_collapse(inspector: Inspector, args: DiagnoseCollapseInput) -> PassPlan[CollapseReport]:
    """Find collapsed heads (low entropy, max weight near 1), what they collapse onto, and whether it matters.

    One forward pass over the requested layers (a :class:`CollapseConsumer`: per-head statistics are accumulated
    per layer and query chunk and the maps are dropped), and the report built from it.
    """
    loaded = inspector.model(args.model)
    stack = inspector.attention_stack(loaded, args.attention)
    layers = inspector.check_layers(loaded, args.layers, stack, "layers")
    heads = inspector.check_heads(loaded, args.heads, stack, "heads")
    encoded = inspector.encode_on(loaded, args.text, stack)
    inspector.require_two_keys(encoded, stack, "collapse needs at least 2 tokens so a query can choose between keys")
    sinks = sink_key_mask([t.special for t in encoded.key_tokens])  # (keys,): position 0 and the special tokens
    grams = output_grams_for(loaded.model, layers, stack.num_heads, stack=stack.name)
    consumer = CollapseConsumer(sinks, heads=heads, threshold=args.threshold, output_grams=grams)

    def finish(_output: object) -> CollapseReport:
        """The report from the consumer's sums: every head's row, the causal check, the words and the PNG."""
        stats = consumer.results()
        numbers = _measure(stats, encoded, stack)
        check = _causal_check(inspector, args, loaded, stack, encoded, numbers.rows) if args.causal_check else None
        if check is not None:
            kinds = {(c.layer, c.head): c.kind for c in check.heads}
            rows = [r.model_copy(update={"kind": kinds.get((r.layer, r.head))}) for r in numbers.rows]
            numbers = replace(numbers, rows=rows, check=check)
        findings = narrative.findings(numbers, top_k=args.top_k)
        png_path = None
        if args.png:  # the layer × head grid of (unrounded) mean max weight; heads not examined are blank
            grid = [[math.nan] * stack.num_heads for _ in range(stack.num_layers)]
            for s in stats:
                grid[s.layer][s.head] = s.mean_max_weight
            where = "" if stack.name == "self" else f"{stack.name}-"
            path = inspector.artifact_path(f"collapse-{loaded.name}-{where}{text_digest(args.text)}", ".png")
            title = f"{loaded.name} — {where}mean max attention weight (1 = collapsed)"
            style = GridStyle("mean max weight", "magma", 0.0, 1.0)
            png_path = str(grid_heatmap([grid[layer] for layer in layers], title, path, style))
        return CollapseReport(
            model=loaded.name,
            summary=on_stack(stack.name, narrative.summary(numbers)),
            findings=findings,
            attention=stack.name,
            num_tokens=numbers.num_tokens,
            threshold=args.threshold,
            heads_examined=len(numbers.rows),
            concentrated_heads=len(numbers.concentrated),
            verdict_counts=numbers.verdict_counts,
            sink_positions=[int(i) for i in sinks.nonzero().flatten().tolist()],
            bound_violations=numbers.bound_violations,
            heads=numbers.rows[: args.top_k],
            check=check,
            png_path=png_path,
        )

    return PassPlan(loaded, encoded, [consumer], finish, layers=layers)


def head_row(stats: HeadCollapse, tokens: Sequence[Token], kv_head: int) -> HeadCollapseRow:
    """One head's statistics as the report states them (rounded by the row's types), positions named by their
    token."""
    top_other = stats.top_other_position
    return HeadCollapseRow.model_validate(
        asdict(stats)
        | {
            "kv_head": kv_head,
            "dominant_token": tokens[stats.dominant_position].text,
            "top_other_token": tokens[top_other].text if top_other is not None else None,
        }
    )


def _measure(stats: Sequence[HeadCollapse], encoded: Encoded, stack: StackFacts) -> CollapseNumbers:
    """Every examined head's row, most collapsed first, with the verdict counts and the bound's row totals."""
    rows = [head_row(s, encoded.key_tokens, stack.kv_head_of(s.head)) for s in rank_heads(stats)]
    counts: dict[str, int] = {v: sum(1 for r in rows if r.verdict == v) for v in sorted({r.verdict for r in rows})}
    return CollapseNumbers(
        num_tokens=len(encoded.query_tokens),
        rows=rows,
        verdict_counts=counts,
        bound_violations=sum(s.bound_violations for s in stats),
        rows_counted=sum(s.rows for s in stats),
    )


# --- the causal check: what removing each collapsed head does, against random heads -------------------------


def _causal_check(
    inspector: Inspector,
    args: DiagnoseCollapseInput,
    loaded: LoadedModel,
    stack: StackFacts,
    encoded: Encoded,
    rows: list[HeadCollapseRow],
) -> CollapseCheck | None:
    """Mean- and resample-ablate each collapsed head (up to ``max_checked``, writing collapses first, most collapsed
    first), all of them together, and the same for random non-collapsed heads; one batched pass of rows.

    None when no head collapsed, or on a decoder/cross stack (the ablation hooks act on the default stack)."""
    collapsed = [r for r in rows if r.verdict in COLLAPSED_VERDICTS]
    if not collapsed or stack.name not in ("self", "encoder"):
        return None
    checked = sorted(collapsed, key=lambda r: r.verdict != "writing_collapse")[: args.max_checked]  # stable
    notes: list[str] = []
    pool = [(r.layer, r.head) for r in rows if r.verdict == "not_collapsed"]
    singles, said = random_sets(pool, 1, args.baseline_draws, seed=args.seed)
    notes += [said] if said else []
    together: HeadSet = tuple(sorted((r.layer, r.head) for r in checked))
    groups: list[HeadSet] = []
    if len(checked) > 1:
        groups, said = random_sets(pool, len(checked), args.baseline_draws, seed=args.seed + 1)
        notes += [f"together: {said}"] if said else []
    resample = resample_source(inspector, loaded, encoded, args.resample_text, seed=args.seed)
    methods: list[AblationMethod] = ["mean"] if resample.ids is None else ["mean", "resample"]
    if resample.ids is None:
        notes.append(f"resample-ablation not run: {resample.description}")
    sets: list[HeadSet] = [((r.layer, r.head),) for r in checked] + ([together] if len(checked) > 1 else [])
    sets += singles + groups
    measured = measure_head_sets(inspector, loaded, encoded, [(s, m) for s in sets for m in methods], resample)
    found = {(e.heads, e.method): e for e in measured.effects}

    def baseline(drawn: list[HeadSet], method: AblationMethod) -> Baseline:
        return baseline_of([found[(s, method)] for s in drawn])

    def effect_rows(heads: HeadSet, drawn: list[HeadSet]) -> dict[str, AblationEffectRow]:
        """Each method's effect of removing ``heads`` against the same method on the ``drawn`` sets, by the rows'
        field (``mean_ablation``, ``resample_ablation``)."""
        return {
            f"{method}_ablation": AblationEffectRow(
                effect=(effect := found[(heads, method)].effect),
                direction=compare_with_baseline(effect, baseline(drawn, method)),
            )
            for method in methods
        }

    def baseline_row(drawn: list[HeadSet]) -> BaselineRow | None:
        """The random draws' mean ± sd per method (None without draws)."""
        if not drawn:
            return None
        spreads = {f"{method}_ablation": ((b := baseline(drawn, method)).mean, b.spread) for method in methods}
        return BaselineRow(draws=len(drawn), heads_per_draw=len(drawn[0]), **spreads)

    def check_row(row: HeadCollapseRow) -> CollapseCheckRow:
        effects = effect_rows(((row.layer, row.head),), singles)
        resample = effects.get("resample_ablation")
        kind = collapse_kind(row.verdict, effects["mean_ablation"].direction, resample.direction if resample else None)
        return CollapseCheckRow(layer=row.layer, head=row.head, verdict=row.verdict, kind=kind, **effects)

    heads = [check_row(r) for r in checked]
    group = None
    if len(checked) > 1:
        group = GroupCheckRow(heads=[head_label(la, he) for la, he in together], **effect_rows(together, groups))
    return CollapseCheck(
        measure="next_token_loss" if measured.loss_clean is not None else "embedding_cosine",
        loss_clean=measured.loss_clean,
        collapsed=len(collapsed),
        checked=len(checked),
        rule=BEYOND_RULE,
        resample_source=resample.description,
        baseline=baseline_row(singles),
        together=group,
        together_baseline=baseline_row(groups),  # no groups are drawn for one checked head
        heads=heads,
        forward_equivalents=round(measured.forward_equivalents, 1),
        notes=notes,
    )
