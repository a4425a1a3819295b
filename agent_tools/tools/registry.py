"""One declaration per tool; every surface (CLI, LangChain, MCP, OpenAI-style) is generated from these."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from agent_tools.errors import AttentionToolError, InvalidInputError
from agent_tools.inspector import CallContext, Inspector, PassPlan, call_scope, check_list_lengths, current_call
from agent_tools.schemas import MAX_NEXT_CALLS, NextCall, Omitted, Report
from agent_tools.usage import type_fix

In = TypeVar("In", bound=BaseModel)
Out = TypeVar("Out", bound=Report)

Order = Literal["largest", "smallest", "largest_abs", "first", "spaced"]
_ORDER_WORDS = {
    "largest": "by {by}, largest first",
    "smallest": "by {by}, smallest first",
    "largest_abs": "by |{by}|, largest first",
    "first": "the first rows, in the list's own order",
    "spaced": "evenly spaced rows, first and last kept, in order",
}


@dataclass(frozen=True)
class Top:
    """A list that ``detail: "summary"`` cuts to its ``limit`` most important rows, most important first.

    ``field`` is a path in the report: ``"heads"``, ``"trace_a.segments"``, ``"stages[].top_keys"`` (``[]``: in
    every row of that list). ``by`` names a number of the row (or is a function of the row) that ranks it by
    ``order``; ``"first"`` keeps the list's own order and ``"spaced"`` thins a series evenly (a curve's points).
    ``label`` says what ``by`` is when it is a function.
    """

    field: str
    limit: int
    by: str | Callable[[Any], float] | None = None
    order: Order = "largest"
    label: str = ""

    def words(self) -> str:
        by = self.label or (self.by if isinstance(self.by, str) else "importance")
        return _ORDER_WORDS[self.order].format(by=by)

    def key(self, row: Any) -> float | None:
        value = self.by(row) if callable(self.by) else getattr(row, self.by) if self.by else None
        return None if value is None else float(value)

    def _signed(self, value: float) -> float:
        """The value as a sort key: the most important first (``largest``/``smallest``/``largest_abs``)."""
        return {"largest": -value, "smallest": value, "largest_abs": -abs(value)}[self.order]

    def select(self, rows: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """(kept, left out): the ``limit`` most important rows, most important first, and the rest."""
        if self.order == "first":
            return list(rows[: self.limit]), list(rows[self.limit :])
        if self.order == "spaced":
            step = (len(rows) - 1) / max(1, self.limit - 1)
            picked = sorted({round(i * step) for i in range(self.limit)})
            chosen = set(picked)
            return [rows[i] for i in picked], [r for i, r in enumerate(rows) if i not in chosen]

        def rank(row: Any) -> tuple[bool, float]:
            value = self.key(row)
            return (True, 0.0) if value is None else (False, self._signed(value))  # rows without it go last

        ordered = sorted(rows, key=rank)  # stable: ties keep the list's order
        return ordered[: self.limit], ordered[self.limit :]

    def cutoff(self, rest: list[Any]) -> float | None:
        """The most important value left out (None when rows are not ranked by a number, or none has one)."""
        if self.order in ("first", "spaced"):
            return None
        values = [v for v in map(self.key, rest) if v is not None]
        return min(values, key=self._signed) if values else None


def _owners(node: Any, path: str) -> Iterator[tuple[Any, str]]:
    """Every (object, attribute) the path ends in: ``a.b[].c`` walks a, each row of b, then names c."""
    head, _, rest = path.partition(".")
    if not rest:
        if isinstance(node, BaseModel) and head in type(node).model_fields:
            yield node, head
        return
    name = head.removesuffix("[]")
    value = getattr(node, name, None) if isinstance(node, BaseModel) else None
    for item in value if head.endswith("[]") and isinstance(value, list) else [value]:
        if item is not None:
            yield from _owners(item, rest)


def trim(report: BaseModel, rules: Sequence[Top]) -> list[Omitted]:
    """Cut the report's declared lists in place (detail 'summary'); what was left out, per list."""
    omitted = []
    for rule in rules:
        kept = total = 0
        left: list[Any] = []  # the rows left out, of every list the path names
        for owner, name in _owners(report, rule.field):
            rows = getattr(owner, name)
            if not isinstance(rows, list):
                continue
            total += len(rows)
            if len(rows) <= rule.limit:
                kept += len(rows)
                continue
            chosen, rest = rule.select(rows)
            setattr(owner, name, chosen)
            kept += len(chosen)
            left += rest
        if kept < total:
            best = rule.cutoff(left)
            cutoff = None if best is None else round(best, 4)
            omitted.append(Omitted(field=rule.field, kept=kept, total=total, order=rule.words(), cutoff=cutoff))
    return omitted


@dataclass(frozen=True)
class ToolSpec(Generic[In, Out]):
    """A tool: its name, the description an LLM reads, typed input and output, and the function."""

    name: str
    description: str
    input_model: type[In]
    output_model: type[Out]
    run: Callable[[Inspector, In], Out] | None  # None: the tool is its ``plan``, run on its own
    example: dict[str, Any]  # valid arguments on the default model: docs, MCP/LangChain tests, smoke runs
    plan: Callable[[Inspector, In], PassPlan[Out]] | None = None  # the pass as a plan others can share
    summary_lists: tuple[Top, ...] = ()  # what detail 'summary' cuts (the report stays ≤ 16 KB)
    next_calls: Callable[[In, Out], list[NextCall]] | None = None  # follow-ups drawn from the results
    advanced: tuple[str, ...] = ()  # accepted, but left out of the schema agents read (tuning knobs)

    def __post_init__(self) -> None:
        if "detail" not in self.input_model.model_fields:
            raise TypeError(f"{self.name}'s input model must derive from DetailInput (every tool takes 'detail')")
        fields = self.input_model.model_fields
        wrong = [a for a in self.advanced if a not in fields or fields[a].is_required() or a in ("detail", "model")]
        if wrong:
            raise TypeError(f"{self.name}: advanced arguments must be optional tuning knobs, not {wrong}")
        if self.run is None and self.plan is None:
            raise TypeError(f"{self.name} declares neither a run nor a plan")

    def parse(self, arguments: dict[str, Any] | In) -> In:
        """Validate raw arguments; errors keep pydantic's detail (field, value, what is valid)."""
        if isinstance(arguments, self.input_model):
            return arguments
        if not isinstance(arguments, dict):
            raise InvalidInputError(f"{self.name} takes a JSON object of arguments, got {type(arguments).__name__}")
        check_list_lengths(arguments)  # every surface: huge lists are refused before any (per-item) check
        try:
            return self.input_model.model_validate(arguments)
        except ValidationError as exc:
            message = format_validation_error(
                self.name, exc, valid=tuple(self.input_model.model_fields), model=self.input_model
            )
            raise InvalidInputError(message, field=_first_field(exc)) from exc

    def __call__(self, inspector: Inspector, arguments: dict[str, Any] | In) -> Out:
        parsed = self.parse(self.resolved(inspector, arguments))
        # a call of its own when the surface opened none, so the report's path gap is never another call's text
        with nullcontext() if current_call() is not None else call_scope(CallContext()):
            try:
                return self.check(self.execute(inspector, parsed), inspector, arguments=parsed)
            except AttentionToolError:
                raise
            except Exception as exc:  # a bug, unless a float16 model overflowed on the input (the operator's dtype)
                overflow = inspector.float16_overflow()
                if overflow is not None:
                    raise overflow from exc
                raise

    def execute(self, inspector: Inspector, arguments: In) -> Out:
        """The tool's report before :meth:`check`: its ``run``, or its ``plan`` run on its own."""
        if self.run is not None:
            return self.run(inspector, arguments)
        assert self.plan is not None
        return inspector.execute(self.plan(inspector, arguments))

    def resolved(self, inspector: Inspector, arguments: dict[str, Any] | In) -> dict[str, Any] | In:
        """The arguments with every text handle (``"@text:..."``, from an earlier report's next calls) replaced
        by the session's text; an argument object holding one is validated again from its resolved fields."""
        if isinstance(arguments, BaseModel):
            given = arguments.model_dump(exclude_unset=True)
            texts = inspector.texts.resolve(given)
            return arguments if texts is given else texts
        return inspector.texts.resolve(arguments) if isinstance(arguments, dict) else arguments

    def prepare(self, inspector: Inspector, arguments: dict[str, Any] | In) -> PassPlan[Out] | None:
        """The tool's forward pass as a shareable plan whose ``finish`` returns the checked report (None when
        the tool declares no plan: call it instead)."""
        if self.plan is None:
            return None
        parsed = self.parse(self.resolved(inspector, arguments))
        return self.plan(inspector, parsed).then(lambda report: self.check(report, inspector, arguments=parsed))

    def check(self, report: Out, inspector: Inspector | None = None, *, arguments: In | None = None) -> Out:
        """Re-validate from plain data: a half-built report object is a bug, not a result. With the session's
        inspector, the report (and every report inside it) states the dtype and device its model ran in.

        With the call's ``arguments``: the follow-up calls are filled in (when the tool did not write its own)
        from the whole report, their long texts named by the session's text handles (with an inspector), then
        detail 'summary' cuts the declared lists (``summary_lists``) and says so in ``omitted``. Without them the
        report is returned whole."""
        if inspector is not None and isinstance(report, BaseModel):
            _state_placement(report, inspector)
        data = report.model_dump() if isinstance(report, BaseModel) else report
        checked = self.output_model.model_validate(data)
        _require_finite(checked.model_dump(), self.name)
        if arguments is None:
            return checked
        if not checked.next_calls and self.next_calls is not None:
            checked.next_calls = self.next_calls(arguments, checked)
        checked.next_calls = checked.next_calls[:MAX_NEXT_CALLS]
        if inspector is not None:  # a long text is named by handle: a call repeats ~40 B, not the 35 KB text
            for call in checked.next_calls:
                call.arguments = inspector.texts.refer(call.arguments)
        if getattr(arguments, "detail", "full") == "summary":
            checked.omitted = trim(checked, self.summary_lists)
            if inspector is not None:  # a text echoed whole (a rendered 8,000-token prompt) goes by handle
                checked.omitted += refer_long_texts(checked, inspector)
        return checked


REPORT_TEXT_LIMIT = 2000  # characters of one string a summary report holds; a longer one is named by handle
_OWN_WORDS = frozenset({"summary", "detail", "why"})  # the report's own sentences: the concise text clips them


def refer_long_texts(report: BaseModel, inspector: Inspector, path: str = "") -> list[Omitted]:
    """Replace, in place, every string of the report longer than ``REPORT_TEXT_LIMIT`` characters (a prompt or
    text the tool echoes) with the session's handle for it (``"@text:..."``, which any tool takes as that text),
    and say so in ``omitted``. The report's own sentences are left to the concise text."""
    omitted: list[Omitted] = []
    for name in type(report).model_fields:
        value = getattr(report, name)
        where = f"{path}.{name}" if path else name
        if isinstance(value, str) and len(value) > REPORT_TEXT_LIMIT and name not in _OWN_WORDS:
            setattr(report, name, inspector.texts.handle(value))
            order = f"a text of {len(value):,} characters, named by its handle (detail 'full' returns it)"
            omitted.append(Omitted(field=where, kept=0, total=len(value), order=order))
        elif isinstance(value, BaseModel) and not isinstance(value, NextCall):
            omitted += refer_long_texts(value, inspector, where)
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            for item in value:
                if not isinstance(item, NextCall):
                    omitted += refer_long_texts(item, inspector, f"{where}[]")
    return omitted


def _state_placement(report: BaseModel, inspector: Inspector) -> None:
    """Fill ``dtype``/``device`` of ``report`` and of the reports it holds, from the model it names."""
    if isinstance(report, Report) and report.dtype is None:
        loaded = inspector.served(report.model)
        if loaded is not None:
            report.dtype = str(loaded.dtype).removeprefix("torch.")
            report.device = str(loaded.device)
    if isinstance(report, Report) and report.attention_path is None:
        report.attention_path = inspector.attention_path(report.model)
    for name in type(report).model_fields:
        value = getattr(report, name)
        if isinstance(value, BaseModel):
            _state_placement(value, inspector)


def _require_finite(value: Any, tool: str, path: str = "") -> None:
    """NaN and infinity have no JSON form (they become null and break output schemas): a report must not hold them."""
    if isinstance(value, float) and not math.isfinite(value):
        raise RuntimeError(f"{tool} produced a non-finite number at {path or 'the top level'}: {value}")
    if isinstance(value, dict):
        for key, item in value.items():
            _require_finite(item, tool, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _require_finite(item, tool, f"{path}[{index}]")


def _first_field(error: ValidationError) -> str | None:
    """The top-level argument the first error is about (None when it is about the whole object)."""
    for item in error.errors():
        location = item.get("loc", ())
        if location:
            return str(location[0])
    return None


_BOUND_ERRORS = frozenset({"greater_than_equal", "less_than_equal", "greater_than", "less_than"})


def _inclusive_range(model: type[BaseModel] | None, name: str) -> tuple[float, float] | None:
    """A top-level field's inclusive bounds ``ge``/``le`` when it declares both (None otherwise)."""
    field = model.model_fields.get(name) if model is not None else None
    if field is None:
        return None
    low = next((m.ge for m in field.metadata if getattr(m, "ge", None) is not None), None)
    high = next((m.le for m in field.metadata if getattr(m, "le", None) is not None), None)
    return (low, high) if low is not None and high is not None else None


def format_validation_error(
    tool: str, error: ValidationError, *, valid: tuple[str, ...] = (), model: type[BaseModel] | None = None
) -> str:
    """One line naming each bad argument, what was wrong and what it got; unknown arguments list the valid ones.

    A number outside a field's inclusive bounds reads ``top_k 0 out of range 1..20`` (as the inspector words
    model-dependent ranges) when ``model`` declares both bounds; every surface and the CLI's early check agree.
    """
    parts = []
    fixed: set[str] = set()
    for item in error.errors():
        location = item.get("loc", ())
        where = ".".join(str(p) for p in location) or "arguments"
        bounds = _inclusive_range(model, str(location[0])) if len(location) == 1 else None
        if item.get("type") == "extra_forbidden":
            known = f" (arguments: {', '.join(valid)})" if valid else ""
            parts.append(f"unknown argument {where!r}{known}")
        elif bounds is not None and item.get("type") in _BOUND_ERRORS:
            parts.append(f"{where} {item.get('input')!r} out of range {_number(bounds[0])}..{_number(bounds[1])}")
        else:
            shown = repr(item.get("input"))
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            fix = _fix(model, location, item) if where not in fixed else ""
            fixed.add(where)
            parts.append(f"{where}: {item.get('msg')} (got {shown})" + (f"; {fix}" if fix else ""))
    return f"invalid arguments for {tool}: " + "; ".join(parts)


def _fix(model: type[BaseModel] | None, location: tuple[Any, ...], item: Any) -> str:
    """The fix for a top-level argument of the wrong type (``"18,6"`` for a head, ``"18"`` for a list), as the
    command line's early check names it (:func:`agent_tools.usage.type_fix`)."""
    kind = str(item.get("type", ""))
    if model is None or len(location) != 1 or not (kind.endswith(("_type", "_parsing")) or kind == "int_from_float"):
        return ""
    name = str(location[0])
    try:
        field = model.model_json_schema()["properties"][name]
    except (KeyError, TypeError, ValueError):
        return ""
    return type_fix(name, item.get("input"), field)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
