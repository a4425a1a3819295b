"""The per-item analysis of a corpus run, through the tools' own declarations (so a row equals the tool's numbers).

* ``profile`` — one forward pass per item shared by two plans (``ToolSpec.prepare`` → ``PassPlan``,
  ``Inspector.run_together``, as the ``analyze`` job does): ``profile_heads``' text roles and
  ``diagnose_collapse``; one row per (item, head) with the role scores, the primary role, entropy, sink share,
  max weight and the collapse verdict.
* ``collapse`` — ``diagnose_collapse`` alone, every head: one row per (item, head) with every statistic of its
  report row.
* ``trace`` — ``trace_prompt_attention`` (target ``last``): one row per (item, segment) with the segment's
  shares, and whether the answer read it most.

This module is at the surfaces' layer (like ``report/job.py``): it calls tools. :mod:`agent_tools.corpus`'s
other modules (readers, store, aggregation) are below the tools and may be used by one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, Literal, Union, cast, get_args, get_origin

from pydantic import BaseModel, ValidationError

from agent_tools.analysis.heads import TEXT_ROLES
from agent_tools.errors import AttentionToolError, InvalidInputError
from agent_tools.inspector import Inspector, PassPlan
from agent_tools.runs.items import CorpusItem, ItemOutcome, Row
from agent_tools.schemas import ChatMessage
from agent_tools.tools import get_tool

Task = Literal["profile", "trace", "collapse", "kv_cache", "retrieval", "position"]
TASKS: tuple[str, ...] = get_args(Task)
PROFILE_HEAD_FIELDS = ("layer", "head", "kv_head")  # profile_heads' row: before the role scores ...
PROFILE_ROLE_FIELDS = ("primary_role", "confidence", "runner_up", "runner_up_score")  # ... and after them
PROFILE_COLLAPSE_FIELDS = (
    "verdict",
    "concentration",
    "mean_entropy",
    "mean_normalised_entropy",
    "mean_max_weight",
    "saturated_fraction",
    "sink_fraction",
)
TRACE_SKIPPED = ("name", "text", "positions", "top_tokens")  # the segment's name becomes ``segment``


def check_task(name: str) -> Task:
    """The task by name, or an input error naming the tasks."""
    if name not in TASKS:
        raise InvalidInputError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}", field="task")
    return cast(Task, name)


@dataclass(frozen=True)
class TaskOptions:
    """What every item of a run is analysed with (part of the run's identity: a resumed run must match)."""

    model: str | None = None

    def base(self) -> dict[str, Any]:
        """Arguments every tool call of the run shares: the whole report (corpus rows need every head)."""
        return {"detail": "full"} | ({"model": self.model} if self.model else {})


def analyse(inspector: Inspector, task: Task, item: CorpusItem, options: TaskOptions) -> ItemOutcome:
    """One item through the task's tools: its rows (each with ``item`` and ``id``), or the error that stopped it.

    Errors an input can cause (empty text, invalid messages, too many tokens) are recorded; anything else is a
    bug and still raises.
    """
    if item.problem is not None:
        return ItemOutcome(item.index, item.id, error_kind="malformed", error=item.problem)
    try:
        rows = RUNNERS[task](inspector, item, options)
    except AttentionToolError as exc:
        return ItemOutcome(item.index, item.id, error_kind=exc.kind, error=" ".join(exc.message.splitlines()))
    return ItemOutcome(item.index, item.id, rows=[{"item": item.index, "id": item.id, **row} for row in rows])


# --- the inputs ---------------------------------------------------------------------------------------------
def _messages(item: CorpusItem) -> list[ChatMessage]:
    """The item's messages, validated (a bad role or a missing content is an input error naming the message)."""
    parsed = []
    for number, message in enumerate(item.messages or []):
        try:
            parsed.append(ChatMessage.model_validate(message))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "message"
            raise InvalidInputError(f"messages[{number}].{where}: {first.get('msg')}", field="messages") from exc
    return parsed


def _text(inspector: Inspector, item: CorpusItem, options: TaskOptions) -> str:
    """The text the head tasks read: the item's text, or its messages rendered with the model's chat template."""
    if item.messages is None:
        return item.text or ""
    loaded = inspector.model(options.model)
    return inspector.render_messages(loaded, _messages(item), add_generation_prompt=False)


def _prepared(inspector: Inspector, tool: str, arguments: dict[str, Any]) -> PassPlan[Any]:
    plan = get_tool(tool).prepare(inspector, arguments)
    if plan is None:  # profile_heads and diagnose_collapse declare plans
        raise RuntimeError(f"{tool} declares no pass plan")
    return plan


def _collapse_plans(inspector: Inspector, arguments: dict[str, Any], options: TaskOptions) -> list[PassPlan[Any]]:
    """diagnose_collapse over every head: one plan, or several over groups of heads when the model has more
    heads than one report lists (they share the pass: same layers, same tokens)."""
    facts = inspector.model(options.model).facts
    field_info = get_tool("diagnose_collapse").input_model.model_fields["top_k"]
    most = min(int(getattr(m, "le", 0)) for m in field_info.metadata if getattr(m, "le", None) is not None)
    per_plan = max(1, most // facts.num_layers)
    groups = [
        list(range(start, min(start + per_plan, facts.num_heads))) for start in range(0, facts.num_heads, per_plan)
    ]
    return [
        _prepared(
            inspector,
            "diagnose_collapse",
            # per-head statistics per item: the ablation check (extra passes per item) is the tool's, not the corpus's
            arguments | {"heads": heads, "top_k": len(heads) * facts.num_layers, "causal_check": False},
        )
        for heads in groups
    ]


def _collapse_rows(reports: list[Any]) -> dict[tuple[int, int], Any]:
    return {(row.layer, row.head): row for report in reports for row in report.heads}


# --- the tasks ----------------------------------------------------------------------------------------------
def profile_rows(inspector: Inspector, item: CorpusItem, options: TaskOptions) -> list[Row]:
    """profile_heads' text roles and diagnose_collapse on one text, in one shared forward pass."""
    arguments = options.base() | {"text": _text(inspector, item, options)}
    profile = _prepared(inspector, "profile_heads", arguments | {"roles": list(TEXT_ROLES), "induction_check": False})
    collapse = _collapse_plans(inspector, arguments, options)
    output = inspector.run_together([profile, *collapse])
    report = profile.finish(output)
    stats = _collapse_rows([plan.finish(output) for plan in collapse])
    rows = []
    for head in report.heads:
        collapsed = stats[(head.layer, head.head)]
        rows.append(
            {
                "num_tokens": report.text_tokens,
                **{name: getattr(head, name) for name in PROFILE_HEAD_FIELDS + PROFILE_ROLE_FIELDS},
                **{f"score_{role}": head.scores.get(role) for role in TEXT_ROLES},
                **{name: getattr(collapsed, name) for name in PROFILE_COLLAPSE_FIELDS},
                "collapsed": collapsed.verdict != "not_collapsed",
            }
        )
    return rows


def collapse_rows(inspector: Inspector, item: CorpusItem, options: TaskOptions) -> list[Row]:
    """diagnose_collapse on one text: every head's report row, in layer, head order."""
    arguments = options.base() | {"text": _text(inspector, item, options)}
    plans = _collapse_plans(inspector, arguments, options)
    output = inspector.run_together(plans)
    reports = [plan.finish(output) for plan in plans]
    stats = _collapse_rows(reports)
    return [
        {
            "num_tokens": reports[0].num_tokens,
            **stats[key].model_dump(),
            "collapsed": stats[key].verdict != "not_collapsed",
        }
        for key in sorted(stats)
    ]


def trace_rows(inspector: Inspector, item: CorpusItem, options: TaskOptions) -> list[Row]:
    """trace_prompt_attention (target 'last') on one prompt: one row per segment, in the report's order."""
    arguments = options.base() | {"prompt": item.prompt, "target": "last"}
    if item.segments:
        arguments["segments"] = item.segments
    report = get_tool("trace_prompt_attention")(inspector, arguments)
    return [
        {
            "num_tokens": report.num_tokens,
            "segment": segment.name,
            **{k: v for k, v in segment.model_dump().items() if k in _scalar_names(type(segment))},
            "read_most": segment.name == report.read_most,
        }
        for segment in report.segments
    ]


def kv_cache_rows(inspector: Inspector, item: CorpusItem, options: TaskOptions) -> list[Row]:
    """plan_kv_cache (its defaults) on one text: one row per KV head with its loss change and whether it is planned."""
    report = get_tool("plan_kv_cache")(inspector, options.base() | {"text": _text(inspector, item, options)})
    return [
        {"num_tokens": report.tokens, **{k: v for k, v in head.model_dump().items() if k != "query_heads"}}
        for head in report.heads
    ]


def retrieval_rows(inspector: Inspector, item: CorpusItem, options: TaskOptions) -> list[Row]:
    """find_retrieval_heads with the text as the haystack (built-in needle): one row per head with its score."""
    report = get_tool("find_retrieval_heads")(inspector, options.base() | {"text": _text(inspector, item, options)})
    tokens = max(h.length for h in report.haystacks)
    return [
        {"num_tokens": tokens, "layer": layer, "head": head, "score": score}
        for layer, scores in enumerate(report.score_grid)
        for head, score in enumerate(scores)
    ]


def position_rows(inspector: Inspector, item: CorpusItem, options: TaskOptions) -> list[Row]:
    """position_sensitivity on one prompt, moving its FIRST named segment among the others: one row per position."""
    if not item.segments or len(item.segments) < 2:
        raise InvalidInputError("the position task needs at least two named segments per item", field="segments")
    first = str(item.segments[0].get("name", ""))
    arguments = options.base() | {"prompt": item.prompt, "segments": item.segments, "move": first}
    report = get_tool("position_sensitivity")(inspector, arguments)
    return [
        {"num_tokens": position.prompt_tokens, **position.model_dump(), "best": position.slot == report.best_slot}
        for position in report.positions
    ]


RUNNERS: dict[str, Callable[[Inspector, CorpusItem, TaskOptions], list[Row]]] = {
    "profile": profile_rows,
    "collapse": collapse_rows,
    "trace": trace_rows,
    "kv_cache": kv_cache_rows,
    "retrieval": retrieval_rows,
    "position": position_rows,
}


# --- the table's columns ------------------------------------------------------------------------------------
ColumnType = Literal["int", "float", "str", "bool"]


def _scalar_type(annotation: Any) -> ColumnType | None:
    """int, float, str (a Literal too) or bool, optionally None; anything else is not a column."""
    args = [annotation]
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
    if len(args) != 1:
        return None
    kind = args[0]
    if get_origin(kind) is Annotated:  # a rounded number (schemas.Rounded) is a float column
        kind = get_args(kind)[0]
    if get_origin(kind) is Literal:
        return "str"
    names: dict[Any, ColumnType] = {bool: "bool", int: "int", float: "float", str: "str"}
    return names.get(kind)


def _scalar_fields(model: type[BaseModel], skip: tuple[str, ...] = ()) -> list[tuple[str, ColumnType]]:
    found = [(name, _scalar_type(info.annotation)) for name, info in model.model_fields.items() if name not in skip]
    return [(name, kind) for name, kind in found if kind is not None]


def _scalar_names(model: type[BaseModel]) -> set[str]:
    return {name for name, _ in _scalar_fields(model, TRACE_SKIPPED)}


def _row_model(tool: str, rows: str) -> type[BaseModel]:
    """The model of one row of a tool's report list ``rows`` (e.g. diagnose_collapse's ``heads``)."""
    (model,) = get_args(get_tool(tool).output_model.model_fields[rows].annotation)
    return cast(type[BaseModel], model)


def columns(task: Task) -> list[tuple[str, ColumnType]]:
    """The table's columns and their types, from the tools' report models (a field added there joins the table)."""
    lead: list[tuple[str, ColumnType]] = [("item", "int"), ("id", "str"), ("num_tokens", "int")]
    if task == "trace":
        segment = _row_model("trace_prompt_attention", "segments")
        return [*lead, ("segment", "str"), *_scalar_fields(segment, TRACE_SKIPPED), ("read_most", "bool")]
    if task == "kv_cache":  # kv_cache_rows: each KV head's report row (its query heads left out: not a scalar)
        return [*lead, *_scalar_fields(_row_model("plan_kv_cache", "heads"))]
    if task == "retrieval":
        return [*lead, ("layer", "int"), ("head", "int"), ("score", "float")]
    if task == "position":
        return [*lead, *_scalar_fields(_row_model("position_sensitivity", "positions")), ("best", "bool")]
    collapse_fields = _scalar_fields(_row_model("diagnose_collapse", "heads"))
    if task == "collapse":
        return [*lead, *collapse_fields, ("collapsed", "bool")]
    profile_fields = dict(_scalar_fields(_row_model("profile_heads", "heads")))
    kinds = dict(collapse_fields)
    return [
        *lead,
        *[(name, profile_fields[name]) for name in PROFILE_HEAD_FIELDS],
        *[(f"score_{role}", "float") for role in TEXT_ROLES],
        *[(name, profile_fields[name]) for name in PROFILE_ROLE_FIELDS],
        *[(name, kinds[name]) for name in PROFILE_COLLAPSE_FIELDS],
        ("collapsed", "bool"),
    ]
