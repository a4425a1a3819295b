"""Agent surfaces generated from the tool declarations in :data:`agent_tools.tools.TOOLS`.

- :mod:`agent_tools.surfaces.langchain`: ``AttentionToolkit`` (StructuredTools, ``content_and_artifact``)
- :mod:`agent_tools.surfaces.mcp_server`: an MCP server (input and output schemas, structured content)
- :mod:`agent_tools.surfaces.openai`: OpenAI-style ``tools`` schemas and a dispatcher

What every surface shares lives here: which tools a session serves, the input model an agent sees (the
``model`` argument narrowed to the session's allow-list), the concise text an LLM reads, the error text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from copy import copy
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, create_model
from pydantic.json_schema import SkipJsonSchema

from agent_tools.errors import AttentionToolError
from agent_tools.policy import ModelPolicy
from agent_tools.schemas import SEVERITIES, NextCall, Report
from agent_tools.tool_declarations import hidden_arguments, model_field_description, served_names, shared_forms

if TYPE_CHECKING:  # the tools import torch: this package's import stays light (the MCP server starts without it)
    from agent_tools.tools.registry import ToolSpec

KEY_NUMBERS_LIMIT = 500  # characters of "key numbers" appended to the summary
CONTENT_LIMIT = 2000  # UTF-8 bytes of the concise text an LLM reads per call (the 2 KB budget)
ARGUMENT_TEXT_LIMIT = 160  # characters of one string argument shown in a "next:" line


def select_tools(names: Iterable[str] | None = None) -> list[ToolSpec]:
    """The declared tools, or the named subset (in declaration order); unknown or repeated names are refused
    (:func:`agent_tools.tool_declarations.served_names`: the declarations equal the registry, a test holds)."""
    from agent_tools.tools import TOOLS

    return [TOOLS[name] for name in served_names(names)]


def agent_input_model(spec: ToolSpec, policy: ModelPolicy) -> type[BaseModel]:
    """The tool's input model as this session's agent sees it.

    When the policy is an allow-list, ``model`` becomes an enum of the allowed references (validation refuses
    paths; LangChain's and OpenAI strict schemas show the choices, :func:`agent_input_schema` a string). The
    tool's ``advanced`` arguments, and ``attention`` when every allowed model has a single attention stack (the
    bundled models do), are left out of the schema to keep the tool list small; they are still accepted.
    Validation otherwise is the declared model's, unchanged.
    """
    declared: type[BaseModel] = spec.input_model
    hidden = hidden_arguments(spec.advanced, declared.model_fields, policy)
    if "model" not in declared.model_fields and not hidden:
        return declared
    return _narrowed_input_model(declared, policy.allowed, policy.default, tuple(hidden))


def agent_input_schema(spec: ToolSpec, policy: ModelPolicy) -> dict[str, Any]:
    """The input schema this session's agent is shown (MCP ``inputSchema``, the plain OpenAI ``parameters``):
    :func:`agent_input_model` in the ``mcp`` flavour with the shared arguments in their compact forms
    (:func:`agent_tools.tool_declarations.shared_forms`; their forms are the instructions' "Arguments" lines)."""
    from agent_tools.surfaces.portable import portable_schema

    return shared_forms(portable_schema(agent_input_model(spec, policy), "mcp"))


@cache
def _narrowed_input_model(
    input_model: type[BaseModel], allowed: frozenset[str] | None, default: str, hidden: tuple[str, ...] = ()
) -> type[BaseModel]:
    fields: dict[str, Any] = {}
    if "model" in input_model.model_fields:
        description = model_field_description(ModelPolicy(allowed, default))
        if allowed is None:
            annotation: Any = str | None
        else:
            # A Literal built at run time from the allow-list: pydantic reads it, mypy cannot check it.
            annotation = Literal[tuple(sorted(allowed))] | None
        fields["model"] = (annotation, Field(default=None, description=description or None))
    for name in hidden:  # accepted as declared, absent from the JSON schema
        info = copy(input_model.model_fields[name])
        fields[name] = (SkipJsonSchema[info.annotation], info)  # type: ignore[misc,name-defined]
    return create_model(input_model.__name__, __base__=input_model, __doc__=input_model.__doc__, **fields)


def _number_text(value: Any) -> str:
    """A scalar as the key-numbers line shows it: strings quoted when they hold spaces, commas or brackets."""
    if isinstance(value, str) and (value != value.strip() or not value or re.search(r"[\s,\[\]=]", value)):
        return repr(value)
    return str(value)


def key_numbers(report: BaseModel, *, limit: int = KEY_NUMBERS_LIMIT) -> str:
    """The report's top-level scalars (and short scalar lists) as ``name=value`` pairs, for the LLM's text; cut
    at a pair, never inside one."""
    skip = {"model", "summary", "findings", "next_calls", "omitted", "detail"}
    parts = []
    for name in type(report).model_fields:
        if name in skip:
            continue
        value = getattr(report, name)
        if value is None or isinstance(value, BaseModel | dict):
            continue
        if isinstance(value, list | tuple):
            if not value or len(value) > 12 or not all(isinstance(v, int | float | str | bool) for v in value):
                continue
            value = "[" + ", ".join(_number_text(v) for v in value) + "]"
        elif isinstance(value, str) and len(value) > 80:
            continue
        else:
            value = _number_text(value)
        parts.append(f"{name}={value}")
    return _join_within(parts, ", ", limit)


def _join_within(parts: list[str], separator: str, limit: int) -> str:
    """As many whole parts as fit in ``limit`` UTF-8 bytes."""
    kept: list[str] = []
    for part in parts:
        if _size(separator.join([*kept, part])) > limit:
            break
        kept.append(part)
    return separator.join(kept)


def _size(text: str) -> int:
    return len(text.encode())


def clip_words(text: str, limit: int) -> str:
    """``text`` within ``limit`` UTF-8 bytes, cut after a whole sentence if one fits, else after a whole word."""
    if _size(text) <= limit:
        return text
    room = limit - _size("…")
    head = text.encode()[:room].decode(errors="ignore")
    sentence = max(head.rfind(". "), head.rfind("; "))
    if sentence > len(head) // 2:
        return head[: sentence + 1] + " …"
    return head[: head.rfind(" ")].rstrip(" ,;:") + "…" if " " in head else head + "…"


def _shortened(value: Any) -> Any:
    if isinstance(value, str) and len(value) > ARGUMENT_TEXT_LIMIT:
        return clip_words(value, ARGUMENT_TEXT_LIMIT)
    if isinstance(value, list):
        return [_shortened(v) for v in value]
    if isinstance(value, dict):
        return {k: _shortened(v) for k, v in value.items()}
    return value


def next_call_text(call: NextCall, *, why: bool = True) -> str:
    """``next: ablate_heads {"heads": ["18.8"], ...} — why`` (string arguments over 160 characters shortened)."""
    arguments = json.dumps(_shortened(call.arguments), ensure_ascii=False)
    return f"next: {call.tool} {arguments}" + (f" — {call.why}" if why and call.why else "")


def omitted_text(report: Report) -> str:
    """``Rows kept (detail 'summary'): heads 10 of 38; runs[].steps/loss 64 of 124. detail='full' returns all.``"""
    if not report.omitted:
        return ""
    texts = [o for o in report.omitted if o.kept == 0 and "handle" in o.order]  # long texts sent by handle
    rows = [o for o in report.omitted if o not in texts]
    named = ", ".join(dict.fromkeys(f"{o.field} ({o.total:,} characters)" for o in texts))
    by_handle = f"Texts sent as @text: handles: {named}." if texts else ""
    if not rows:
        return by_handle
    groups: dict[tuple[str, int, int], list[str]] = {}
    for o in rows:  # lists cut alike under one parent (a curve's series) are named together
        parent, _, leaf = o.field.rpartition(".")
        groups.setdefault((parent, o.kept, o.total), []).append(leaf)
    cut = "; ".join(
        f"{parent + '.' if parent else ''}{'/'.join(leaves)} {kept} of {total}"
        for (parent, kept, total), leaves in groups.items()
    )
    return " ".join(filter(None, [f"Rows kept (detail 'summary'): {cut}. detail='full' returns all.", by_handle]))


def concise_text(report: Report, *, limit: int = CONTENT_LIMIT) -> str:
    """What an LLM reads (LangChain content, MCP text, the OpenAI tool message): at most ``limit`` bytes.

    The summary comes whole; then the findings by severity (high first), the follow-up calls, the key numbers
    and what detail 'summary' left out. When it does not all fit, the least important lines are left out —
    low findings first — and no line is cut inside a word (only a summary longer than the budget is shortened,
    after a sentence)."""
    summary = clip_words(report.summary, limit)
    order = {s: i for i, s in enumerate(SEVERITIES)}
    findings = sorted(report.findings, key=lambda f: order.get(f.severity, 1))  # stable: ties keep their order
    lines: dict[str, list[str]] = {"findings": [], "numbers": [], "omitted": [], "next": []}
    used = _size(summary)

    def take(block: str, line: str) -> bool:
        nonlocal used
        if not line or used + 1 + _size(line) > limit:
            return False
        lines[block].append(line)
        used += 1 + _size(line)
        return True

    for finding in findings:
        if finding.severity == "high":
            take("findings", f"- {finding.detail}")
    for call in report.next_calls:
        take("next", next_call_text(call, why=False))
    for finding in findings:
        if finding.severity == "medium":
            take("findings", f"- {finding.detail}")
    take("omitted", omitted_text(report))
    room = limit - used - 1 - _size("Key numbers: ")
    numbers = key_numbers(report, limit=min(KEY_NUMBERS_LIMIT, room)) if room > 0 else ""
    take("numbers", f"Key numbers: {numbers}" if numbers else "")
    for finding in findings:
        if finding.severity == "low":
            take("findings", f"- {finding.detail}")
    for index, line in enumerate(lines["next"]):  # each call's reason, where the budget still has room
        call = next(c for c in report.next_calls if next_call_text(c, why=False) == line)
        longer = next_call_text(call)
        if used + _size(longer) - _size(line) <= limit:
            lines["next"][index] = longer
            used += _size(longer) - _size(line)
    # shown in reading order: findings as ranked, whatever block order they were admitted in
    shown = set(lines["findings"])
    ordered = [f"- {f.detail}" for f in findings if f"- {f.detail}" in shown]
    return "\n".join([summary, *dict.fromkeys(ordered), *lines["numbers"], *lines["omitted"], *lines["next"]])


def error_text(tool: str, error: AttentionToolError) -> str:
    """The error message an agent reads: what went wrong, naming what is valid, and that it can retry."""
    where = f" (argument {error.field!r})" if error.field else ""
    return f"Error [{error.kind}]{where}: {error.message.rstrip('.')}. Fix the arguments and call {tool} again."
