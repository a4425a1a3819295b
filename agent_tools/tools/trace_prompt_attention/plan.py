"""trace_prompt_attention's pass: the shared traced-prompt pass (:mod:`agent_tools.prompt_trace`) on one prompt.

Not a :class:`~agent_tools.inspector.PassPlan`: target 'generate' runs greedy generation, not one forward.
"""

from __future__ import annotations

from agent_tools.inspector import Inspector
from agent_tools.prompt_trace.evidence import EvidenceRequest
from agent_tools.prompt_trace.models import PromptTrace
from agent_tools.prompt_trace.report import trace
from agent_tools.tools.trace_prompt_attention.models import TracePromptInput


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
    return trace(
        inspector,
        loaded,
        args.prompt,
        args.segments,
        target=args.target,
        max_new_tokens=args.max_new_tokens,
        top_k=args.top_k,
        sink_threshold=args.sink_threshold,
        evidence=EvidenceRequest.of(
            args.checks,
            answer=args.answer,
            neutral_token=args.neutral_token,
            ig_steps=args.ig_steps,
            exclude_filler=args.exclude_filler,
        ),
        attention=args.attention,
        answer_stop=args.answer_stop,
    ).report
