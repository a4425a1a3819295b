"""trace_prompt_attention's pass and report: the shared traced-prompt pass (:mod:`agent_tools.traced_prompt`) on one
prompt, its numbers, and this tool's words about them (:mod:`.narrative`, :mod:`.claims`, :mod:`.next_calls`).

Not a :class:`~agent_tools.inspector.PassPlan`: target 'generate' runs greedy generation, not one forward.
"""

from __future__ import annotations

from agent_tools.inspector import Inspector
from agent_tools.stack_input import on_stack
from agent_tools.tools.trace_prompt_attention.claims import view_leads
from agent_tools.tools.trace_prompt_attention.models import PromptTrace, TracePromptInput
from agent_tools.tools.trace_prompt_attention.narrative import narrate
from agent_tools.tools.trace_prompt_attention.next_calls import trace_next_calls
from agent_tools.traced_prompt.evidence import EvidenceRequest
from agent_tools.traced_prompt.run import check_prompt, check_stack, trace, trace_options


def trace_prompt_attention(inspector: Inspector, args: TracePromptInput) -> PromptTrace:
    """Which parts of a prompt the answer reads: attention shares per segment (roles, turns, named spans).

    The prompt is split into segments (system#1, user#1, assistant#1, ..., the chat template's own tokens, the
    spans you name, and the sink tokens kept apart); the attention of the last prompt position — or of every
    token the model generates greedily — is summed per segment: averaged over layers and heads, in the last
    layer, and by rollout. Reports the top tokens read in each segment and, per generated token, the segment
    it read most. Beside that, the evidence checks (``checks``) say what the answer depends on: causal effects of
    removing / neutralising each segment, value-weighted shares with filler set apart, integrated gradients.
    """
    loaded = inspector.model(args.model)
    request = EvidenceRequest.of(args)
    check_stack(inspector, loaded, args.attention, request)
    checked = check_prompt(inspector, loaded, args.prompt, args.segments, request)
    run = trace(inspector, loaded, checked, top_k=args.top_k, **trace_options(args))
    traced = run.traced
    summary, findings = narrate(run)
    report = PromptTrace(
        **dict(run.measured),
        model=loaded.name,
        attention=traced.stack,
        summary=on_stack(traced.stack, summary),
        findings=findings,
        rendered_prompt=traced.prompt.encoded.text,
        views=view_leads(run),
    )
    report.next_calls = trace_next_calls(report, traced, args)
    return report
