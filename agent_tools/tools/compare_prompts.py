"""compare_prompts: how attention over the prompt's parts shifts between two variants, and what the output does."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from agent_tools.analysis.segments import kl_divergence, share_changes
from agent_tools.generation import MAX_NEW_TOKENS
from agent_tools.inspector import Inspector
from agent_tools.schemas import Finding, ModelInput, Report, rounded
from agent_tools.segments import PromptMessage, SegmentSpec, segment_prompt
from agent_tools.tools.registry import ToolSpec
from agent_tools.tools.trace_prompt_attention import (
    DEFAULT_SINK_THRESHOLD,
    PROMPT_DESCRIPTION,
    SINK_DESCRIPTION,
    TARGET_DESCRIPTION,
    PromptTrace,
    Target,
    TokenProbability,
    check_traceable,
    max_new_tokens_in_range,
    trace,
)

SHIFTS_SHOWN = 3


class ComparePromptsInput(ModelInput):
    prompt_a: str | list[PromptMessage] = Field(description="the first variant: " + PROMPT_DESCRIPTION)
    prompt_b: str | list[PromptMessage] = Field(description="the second variant, same form")
    segments_a: list[SegmentSpec] | None = Field(default=None, description="named segments of prompt_a")
    segments_b: list[SegmentSpec] | None = Field(
        default=None, description="named segments of prompt_b (give the same names to compare them)"
    )
    target: Target = Field(default="last", description=TARGET_DESCRIPTION)
    max_new_tokens: int = Field(
        default=16,
        ge=1,
        le=MAX_NEW_TOKENS,
        description=f"tokens to generate with target='generate' (1..{MAX_NEW_TOKENS})",
    )
    sink_threshold: float = Field(default=DEFAULT_SINK_THRESHOLD, gt=0, le=1, description=SINK_DESCRIPTION)

    _max_new_tokens_range = field_validator("max_new_tokens", mode="before")(max_new_tokens_in_range)


class SegmentComparison(BaseModel):
    name: str = Field(description="segment name, matched across the variants (role and turn, or the name given)")
    kind: str
    share_a: float | None = Field(description="share in variant A (mean over layers and heads); None: absent")
    share_b: float | None
    change: float = Field(description="share_b - share_a (an absent segment counts as 0)")
    share_without_sink_a: float | None
    share_without_sink_b: float | None
    last_layer_a: float | None
    last_layer_b: float | None
    rollout_without_sink_a: float | None
    rollout_without_sink_b: float | None
    token_count_a: int
    token_count_b: int


class PromptComparison(Report):
    target: Target
    segments: list[SegmentComparison] = Field(description="every segment of either variant, largest |change| first")
    read_most_a: str
    read_most_b: str
    next_token_kl: float | None = Field(
        description="KL(P_a ‖ P_b) in nats between the next-token distributions at the last prompt positions"
    )
    next_tokens_a: list[TokenProbability] | None
    next_tokens_b: list[TokenProbability] | None
    same_top_token: bool | None
    generated_text_a: str | None = None
    generated_text_b: str | None = None
    first_difference: int | None = Field(
        default=None, description="first generated step where the variants chose different tokens (None: same)"
    )
    trace_a: PromptTrace
    trace_b: PromptTrace


def _by_name(report: PromptTrace, field: str) -> dict[str, float | None]:
    return {s.name: getattr(s, field) for s in report.segments}


def compare_prompts(inspector: Inspector, args: ComparePromptsInput) -> PromptComparison:
    """Compare two prompt variants: segment shares side by side, the largest shifts, and the change in output.

    Segments are matched by name (system#1, user#2, template, sink, generated, or the names you give). The
    output change is the KL divergence between the two next-token distributions at the answer position and
    their top tokens, plus the generated texts for target 'generate'.
    """
    loaded = inspector.model(args.model)
    variants = (("prompt_a", args.prompt_a, args.segments_a), ("prompt_b", args.prompt_b, args.segments_b))
    for field, prompt, named in variants:  # both variants valid (text, segments, length) before either runs
        check_traceable(segment_prompt(inspector, loaded, prompt, named), field)
    options = {"target": args.target, "max_new_tokens": args.max_new_tokens, "sink_threshold": args.sink_threshold}
    run_a = trace(inspector, loaded, args.prompt_a, args.segments_a, **options)  # type: ignore[arg-type]
    run_b = trace(inspector, loaded, args.prompt_b, args.segments_b, **options)  # type: ignore[arg-type]
    a, b = run_a.report, run_b.report
    kinds = {s.name: s.kind for s in [*b.segments, *a.segments]}
    counts_a = {s.name: s.token_count for s in a.segments}
    counts_b = {s.name: s.token_count for s in b.segments}
    columns = {
        f: (_by_name(a, f), _by_name(b, f))
        for f in ("share_without_sink", "last_layer_share", "rollout_share_without_sink")
    }
    rows = []
    for name, share_a, share_b, change in share_changes(_by_name(a, "share"), _by_name(b, "share")):
        rows.append(
            SegmentComparison(
                name=name,
                kind=kinds[name],
                share_a=share_a,
                share_b=share_b,
                change=rounded(change),
                share_without_sink_a=columns["share_without_sink"][0].get(name),
                share_without_sink_b=columns["share_without_sink"][1].get(name),
                last_layer_a=columns["last_layer_share"][0].get(name),
                last_layer_b=columns["last_layer_share"][1].get(name),
                rollout_without_sink_a=columns["rollout_share_without_sink"][0].get(name),
                rollout_without_sink_b=columns["rollout_share_without_sink"][1].get(name),
                token_count_a=counts_a.get(name, 0),
                token_count_b=counts_b.get(name, 0),
            )
        )

    findings = []
    for row in rows[:SHIFTS_SHOWN]:
        shown_a = "absent" if row.share_a is None else f"{row.share_a:.1%}"
        shown_b = "absent" if row.share_b is None else f"{row.share_b:.1%}"
        findings.append(
            Finding(
                kind="share_shift",
                value=row.change,
                detail=f"{row.name!r}: {shown_a} -> {shown_b} ({row.change * 100:+.1f} points)",
            )
        )
    kl = None
    same_top = None
    if run_a.answer_logits is not None and run_b.answer_logits is not None:
        kl = kl_divergence(run_a.answer_logits, run_b.answer_logits)
        same_top = int(run_a.answer_logits.argmax()) == int(run_b.answer_logits.argmax())
        top_a, top_b = a.next_tokens[0], b.next_tokens[0]  # type: ignore[index]
        findings.append(
            Finding(
                kind="next_token_kl",
                value=rounded(kl),
                detail=f"next-token KL(A‖B) = {kl:.3f} nats; top token {top_a.token!r} ({top_a.probability:.1%}) -> "
                f"{top_b.token!r} ({top_b.probability:.1%})",
            )
        )
    first_difference = None
    if args.target == "generate":
        ids_a = [g.token_id for g in a.generated or []]
        ids_b = [g.token_id for g in b.generated or []]
        first_difference = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y), None)
        if first_difference is None and len(ids_a) != len(ids_b):
            first_difference = min(len(ids_a), len(ids_b))
        findings.append(
            Finding(
                kind="generated",
                value=float(first_difference) if first_difference is not None else None,
                detail=f"A wrote {a.generated_text!r}, B wrote {b.generated_text!r}"
                + ("" if first_difference is None else f" (first different token at step {first_difference})"),
            )
        )

    biggest = rows[0]
    summary = (
        f"A reads {a.read_most!r} most, B reads {b.read_most!r} most. The largest shift is {biggest.name!r}: "
        f"{'absent' if biggest.share_a is None else f'{biggest.share_a:.1%}'} -> "
        f"{'absent' if biggest.share_b is None else f'{biggest.share_b:.1%}'} ({biggest.change * 100:+.1f} points)"
    )
    if len(rows) > 1:
        second = rows[1]
        summary += f", then {second.name!r} ({second.change * 100:+.1f} points)"
    summary += "."
    if kl is not None:
        summary += (
            f" Next-token KL(A‖B) = {kl:.3f} nats; top token {a.next_tokens[0].token!r} -> "  # type: ignore[index]
            f"{b.next_tokens[0].token!r}."  # type: ignore[index]
        )
    if args.target == "generate":
        summary += f" Generated: A {a.generated_text!r}, B {b.generated_text!r}" + (
            " (identical)." if first_difference is None else f" (differ from step {first_difference})."
        )
    return PromptComparison(
        model=loaded.name,
        summary=summary,
        findings=findings,
        target=args.target,
        segments=rows,
        read_most_a=a.read_most,
        read_most_b=b.read_most,
        next_token_kl=rounded(kl) if kl is not None else None,
        next_tokens_a=a.next_tokens,
        next_tokens_b=b.next_tokens,
        same_top_token=same_top,
        generated_text_a=a.generated_text,
        generated_text_b=b.generated_text,
        first_difference=first_difference,
        trace_a=a,
        trace_b=b,
    )


SPEC = ToolSpec(
    name="compare_prompts",
    description=(
        "Compare two prompt variants (texts or chat message lists): each segment's share of the answer's attention "
        "side by side (matched by role/turn and by the names you give), the largest shifts, and how the output "
        "changed — KL divergence and top tokens of the next-token distribution, or the generated texts."
    ),
    input_model=ComparePromptsInput,
    output_model=PromptComparison,
    run=compare_prompts,
    example={
        "prompt_a": "The secret code is 4721. Question: what is the secret code? Answer:",
        "prompt_b": "Question: what is the secret code? The secret code is 4721. Answer:",
    },
)
