"""attention_rollout: how much does each input token flow into one position through all the layers?

``models`` holds the arguments and report, ``plan`` the pass (a :class:`~agent_tools.inspector.PassPlan`
streaming :class:`~agent_tools.consumers.rollout.RolloutConsumer` and
:class:`~agent_tools.consumers.target_row.TargetRowConsumer`), ``narrative`` the summary and findings.
"""

from __future__ import annotations

from agent_tools.tools.attention_rollout.models import DESCRIPTION, AttentionRolloutInput, RolloutReport
from agent_tools.tools.attention_rollout.narrative import next_calls
from agent_tools.tools.attention_rollout.plan import plan_attention_rollout
from agent_tools.tools.registry import ToolSpec, Top

__all__ = [
    "SPEC",
    "AttentionRolloutInput",
    "RolloutReport",
    "plan_attention_rollout",
]

SPEC = ToolSpec(
    name="attention_rollout",
    description=DESCRIPTION,
    input_model=AttentionRolloutInput,
    output_model=RolloutReport,
    run=None,
    plan=plan_attention_rollout,
    example={"text": "The cat sat on the mat because it was tired."},
    summary_lists=(Top("sources", 16, by="share"),),
    next_calls=next_calls,
    advanced=("residual", "top_k"),
)
