"""Every forward pass of the model: captured passes, greedy generation, head-ablated passes (a module each).

Only this package calls a model's ``forward``; the :class:`~agent_tools.inspector.Inspector` validates the
request (token limits, budgets, indices) and calls these functions, and tools call the inspector. Each
function holds the model's lock for the whole pass and runs under ``torch.inference_mode``; hooks live only
inside the context managers of :mod:`agent_tools.capture` and :mod:`agent_tools.intervene`, removed in
``finally``.
"""

from agent_tools.runner.ablation import (
    AblationEffect,
    HeadSetAblation,
    ablated_forward,
    ablated_rows,
    head_outputs,
    mean_head_outputs,
)
from agent_tools.runner.forward import answer_logits, captured_forward, encoder_of, model_output, on_device
from agent_tools.runner.generation import (
    Generation,
    StopReason,
    StopRule,
    decoder_start_id,
    greedy_generate,
    seq2seq_generate,
    stop_token_ids,
)

__all__ = [
    "AblationEffect",
    "Generation",
    "HeadSetAblation",
    "StopReason",
    "StopRule",
    "ablated_forward",
    "ablated_rows",
    "answer_logits",
    "captured_forward",
    "decoder_start_id",
    "encoder_of",
    "greedy_generate",
    "head_outputs",
    "mean_head_outputs",
    "model_output",
    "on_device",
    "seq2seq_generate",
    "stop_token_ids",
]
