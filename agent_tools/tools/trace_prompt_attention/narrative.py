"""trace_prompt_attention's narrative lives in :mod:`agent_tools.prompt_trace.narrative`.

compare_prompts embeds whole traces (``trace_a``, ``trace_b``, with their summaries and findings), so the
text is written by the shared service, not here; this module names it for readers of the tool's package.
"""

from __future__ import annotations

from agent_tools.prompt_trace.narrative import Answer, narrate, peak_findings

__all__ = ["Answer", "narrate", "peak_findings"]
