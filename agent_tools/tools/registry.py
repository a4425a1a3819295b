"""One declaration per tool; every surface (CLI, LangChain, MCP, OpenAI-style) is generated from these."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector, PassPlan, check_list_lengths
from agent_tools.schemas import Report

In = TypeVar("In", bound=BaseModel)
Out = TypeVar("Out", bound=Report)


@dataclass(frozen=True)
class ToolSpec(Generic[In, Out]):
    """A tool: its name, the description an LLM reads, typed input and output, and the function."""

    name: str
    description: str
    input_model: type[In]
    output_model: type[Out]
    run: Callable[[Inspector, In], Out]
    example: dict[str, Any]  # valid arguments on the default model: docs, MCP/LangChain tests, smoke runs
    plan: Callable[[Inspector, In], PassPlan[Out]] | None = None  # the pass as a plan others can share

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
            message = format_validation_error(self.name, exc, valid=tuple(self.input_model.model_fields))
            raise InvalidInputError(message, field=_first_field(exc)) from exc

    def __call__(self, inspector: Inspector, arguments: dict[str, Any] | In) -> Out:
        return self.check(self.run(inspector, self.parse(arguments)), inspector)

    def prepare(self, inspector: Inspector, arguments: dict[str, Any] | In) -> PassPlan[Out] | None:
        """The tool's forward pass as a shareable plan whose ``finish`` returns the checked report (None when
        the tool declares no plan: call it instead)."""
        if self.plan is None:
            return None
        plan = self.plan(inspector, self.parse(arguments))
        finish = plan.finish
        plan.finish = lambda output: self.check(finish(output), inspector)
        return plan

    def check(self, report: Out, inspector: Inspector | None = None) -> Out:
        """Re-validate from plain data: a half-built report object is a bug, not a result. With the session's
        inspector, the report (and every report inside it) states the dtype and device its model ran in."""
        if inspector is not None and isinstance(report, BaseModel):
            _state_placement(report, inspector)
        data = report.model_dump() if isinstance(report, BaseModel) else report
        checked = self.output_model.model_validate(data)
        _require_finite(checked.model_dump(), self.name)
        return checked


def _state_placement(report: BaseModel, inspector: Inspector) -> None:
    """Fill ``dtype``/``device`` of ``report`` and of the reports it holds, from the model it names."""
    if isinstance(report, Report) and report.dtype is None:
        loaded = inspector.served(report.model)
        if loaded is not None:
            report.dtype = str(loaded.dtype).removeprefix("torch.")
            report.device = str(loaded.device)
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


def format_validation_error(tool: str, error: ValidationError, *, valid: tuple[str, ...] = ()) -> str:
    """One line naming each bad argument, what was wrong and what it got; unknown arguments list the valid ones."""
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item.get("loc", ())) or "arguments"
        if item.get("type") == "extra_forbidden":
            known = f" (arguments: {', '.join(valid)})" if valid else ""
            parts.append(f"unknown argument {where!r}{known}")
        else:
            shown = repr(item.get("input"))
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            parts.append(f"{where}: {item.get('msg')} (got {shown})")
    return f"invalid arguments for {tool}: " + "; ".join(parts)
