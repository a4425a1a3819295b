"""compare_prompts' pass: trace both variants with the shared traced-prompt pass, then match their segments by name."""

from __future__ import annotations

from typing import Any

from agent_tools.analysis.metrics import kl_divergence
from agent_tools.analysis.segments import share_changes
from agent_tools.inspector import Inspector
from agent_tools.schemas import NextCall
from agent_tools.stack_input import on_stack
from agent_tools.tools.compare_prompts.models import ComparePromptsInput, PromptComparison, SegmentComparison
from agent_tools.tools.compare_prompts.narrative import Comparison, narrate
from agent_tools.traced_prompt.evidence import EvidenceRequest
from agent_tools.traced_prompt.models import MeasuredTrace, TokenProbability, generation_arguments, prompt_argument
from agent_tools.traced_prompt.run import TraceRun, check_prompt, check_stack, trace, trace_options

COMPARED = {  # SegmentComparison's column -> the trace's field, one column per variant (_a, _b)
    "share_without_sink": "share_without_sink",
    "last_layer": "last_layer_share",
    "rollout_without_sink": "rollout_share_without_sink",
    "token_count": "token_count",
    "removed": "removed",
    "value_share": "value_share",
}


PER_VARIANT = ("read_most", "next_tokens", "generated_text", "depends_on_most")  # a trace's fields the report pairs


def compare_prompts(inspector: Inspector, args: ComparePromptsInput) -> PromptComparison:
    """Compare two prompt variants: segment shares side by side, the largest shifts, and the change in output.

    Segments are matched by name (system#1, user#2, template, sink, generated, or the names you give). The
    output change is the KL divergence between the two next-token distributions at the answer position and
    their top tokens, plus the generated texts for target 'generate'.
    """
    loaded = inspector.model(args.model)
    variants = (("prompt_a", args.prompt_a, args.segments_a), ("prompt_b", args.prompt_b, args.segments_b))
    request = EvidenceRequest.of(args)
    prepared = [  # both variants valid (text, segments, checks) before either runs
        check_prompt(inspector, loaded, prompt, named, request, field=field) for field, prompt, named in variants
    ]
    check_stack(inspector, loaded, args.attention, request)
    run_a, run_b = (trace(inspector, loaded, prompt, **trace_options(args)) for prompt in prepared)
    comparison = compare(run_a, run_b, generated=args.target == "generate")
    summary, findings = narrate(comparison)
    paired: dict[str, Any] = {}  # each trace, and its own fields, as <field>_a / <field>_b
    for side, measured in (("a", comparison.a), ("b", comparison.b)):
        paired |= {f"{field}_{side}": getattr(measured, field) for field in PER_VARIANT}
        paired |= {f"inserted_{side}": [s.name for s in measured.segments if s.kind == "inserted"]}
        paired |= {f"trace_{side}": measured}
    return PromptComparison(
        model=loaded.name,
        attention=run_a.traced.stack,
        summary=on_stack(run_a.traced.stack, summary),
        findings=findings,
        target=args.target,
        segments=comparison.rows,
        next_token_kl=comparison.kl,
        same_top_token=comparison.same_top_token,
        first_difference=comparison.first_difference,
        **paired,
        next_calls=_next_calls(loaded.name, args, comparison),
    )


def _next_calls(model: str, args: ComparePromptsInput, comparison: Comparison) -> list[NextCall]:
    """Confirm what moved: each variant's own trace with gradient checks, when the answers' dependence differs."""
    calls = []
    for name, trace_report, prompt, named in (
        ("A", comparison.a, args.prompt_a, args.segments_a),
        ("B", comparison.b, args.prompt_b, args.segments_b),
    ):
        arguments: dict = {
            "model": model,
            "prompt": prompt_argument(prompt),
            **generation_arguments(args.target, args.answer_stop, args.max_new_tokens),
        }
        if args.answer is not None:
            arguments["answer"] = args.answer
        if named:
            arguments["segments"] = [spec.model_dump(exclude_none=True) for spec in named]
        lead = trace_report.moves_most or trace_report.read_most
        if args.checks is None:  # the trace's own default checks (the removal check where there are segments)
            why = f"variant {name} alone, segment by segment: what its answer reads and depends on around {lead!r}"
        elif "causal" in args.checks:  # the removal check was asked for: add the gradient check beside it
            arguments["checks"] = ["causal", "gradient", "value"]
            why = (
                f"variant {name} alone with the gradient check too (an approximation of removal, its agreement "
                f"reported): per-token effects around {lead!r}"
            )
        else:  # the checks this call ran (the removal check needs at least two segments to compare)
            arguments["checks"] = list(args.checks)
            why = f"variant {name} alone, segment by segment: what its answer reads around {lead!r}"
        calls.append(NextCall(tool="trace_prompt_attention", arguments=arguments, why=why))
    return calls


def compare(run_a: TraceRun, run_b: TraceRun, *, generated: bool) -> Comparison:
    """Match the two traces' segments by name and measure how the output changed."""
    a, b = run_a.measured, run_b.measured
    kl: float | None = None
    top_tokens: tuple[TokenProbability, TokenProbability] | None = None
    same_top: bool | None = None
    logits_a, logits_b = run_a.traced.answer_logits, run_b.traced.answer_logits
    if logits_a is not None and logits_b is not None and a.next_tokens and b.next_tokens:
        kl = float(kl_divergence(logits_a, logits_b))  # (V,) logits -> nats
        same_top = int(logits_a.argmax()) == int(logits_b.argmax())
        top_tokens = (a.next_tokens[0], b.next_tokens[0])
    return Comparison(
        a=a,
        b=b,
        rows=segment_rows(a, b),
        kl=kl,
        top_tokens=top_tokens,
        same_top_token=same_top,
        generated=generated,
        first_difference=_first_difference(a, b) if generated else None,
    )


def _by_name(report: MeasuredTrace, field: str) -> dict[str, Any]:
    if field == "removed":
        return {s.name: s.causal.removed for s in report.segments if s.causal}
    return {s.name: getattr(s, field) for s in report.segments}


def segment_rows(a: MeasuredTrace, b: MeasuredTrace) -> list[SegmentComparison]:
    """Every segment of either trace, matched by name, largest |share change| first."""
    kinds = {s.name: s.kind for s in [*b.segments, *a.segments]}
    columns = {
        f"{column}_{side}": _by_name(trace_report, field)
        for column, field in COMPARED.items()
        for side, trace_report in (("a", a), ("b", b))
    }
    return [
        SegmentComparison.model_validate(
            {"name": name, "kind": kinds[name], "share_a": share_a, "share_b": share_b, "change": change}
            | {column: values.get(name, 0 if "count" in column else None) for column, values in columns.items()}
        )
        for name, share_a, share_b, change in share_changes(_by_name(a, "share"), _by_name(b, "share"))
    ]


def _first_difference(a: MeasuredTrace, b: MeasuredTrace) -> int | None:
    """First generated step where the variants chose different tokens; a shorter answer differs where it ends."""
    ids_a = [g.token_id for g in a.generated or []]
    ids_b = [g.token_id for g in b.generated or []]
    first = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y), None)
    if first is None and len(ids_a) != len(ids_b):
        first = min(len(ids_a), len(ids_b))
    return first
