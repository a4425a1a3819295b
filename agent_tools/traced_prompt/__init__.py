"""The traced-prompt pass both prompt tools share: which of a prompt's segments (system, user turns, named spans,
template, sink) the answer reads, what it depends on, and the numbers that say so — no words.

``trace_prompt_attention`` writes its report (summary, findings, views, next calls) from one trace;
``compare_prompts`` traces two variants and embeds each one's numbers. Neither tool imports the other:

* :mod:`.models` — the number models both reports embed (:class:`~.models.MeasuredTrace`, a segment's
  :class:`~.models.SegmentShare`, ...), :data:`~.models.Target`, and the argument descriptions both tools use;
* :mod:`.measure` — the traced pass through the inspector (:func:`~.measure.trace_pass`) and the numbers it
  yields (:func:`~.measure.measure`);
* :mod:`.answer` — where a generated answer ends (``answer_stop``) and which tokens the checks measure;
* :mod:`.evidence` — the checks beside attention (causal effects, gradient attribution) and how the measures
  rank the segments (:func:`~.evidence.verdict`);
* :mod:`.rows` — those numbers as report rows: :func:`~.rows.measured_trace`;
* :mod:`.run` — :func:`~.run.check_prompt` (segment, check the request) and :func:`~.run.trace` (pass, checks,
  rows, in one :class:`~.run.TraceRun`).

Prompts are split into segments by :mod:`agent_tools.prompt_segments`.
"""
