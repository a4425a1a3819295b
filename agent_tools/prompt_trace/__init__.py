"""Tracing a prompt: which of its segments (system, user turns, named spans, template, sink) the answer reads.

A service shared by the prompt tools (``trace_prompt_attention`` reports one trace, ``compare_prompts`` two),
so that neither tool imports the other:

* :mod:`.models` — the report models (:class:`PromptTrace`), :data:`Target`, and the argument descriptions
  both tools use;
* :mod:`.measure` — the traced pass through the inspector (:func:`trace_pass`) and the numbers it yields
  (:func:`measure`);
* :mod:`.narrative` — the findings and summary, written from those numbers;
* :mod:`.answer` — where a generated answer ends (``answer_stop``) and which tokens the checks measure;
* :mod:`.evidence` — the checks beside attention (causal effects, gradient attribution) and how the measures
  rank the segments; :mod:`.claims` — their words; :mod:`.next_calls` — the calls that would test the lead;
* :mod:`.report` — :func:`trace`: pass, numbers, checks, rows and narrative assembled into a :class:`PromptTrace`.

Prompts are split into segments by :mod:`agent_tools.prompt_segments`.
"""
