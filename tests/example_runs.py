"""Every tool's example analysed once per test process on the default model, for the tests that need each tool's
answer to its example: ``tests/test_budgets.py`` cuts and measures these runs, and the LangChain surface's
every-tool test serves them through ``make_tool`` (the surface is under test there, not the analysis). Both files
are one xdist group (``xdist_group("example_runs")``), so that the runs are made once in the suite.

A replayed tool answers its example's arguments only (any ``detail``); other arguments are a test's mistake."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from agent_tools.inspector import Inspector
from agent_tools.tools import TOOLS
from agent_tools.tools.registry import ToolSpec


class ExampleRuns:
    """``spec.execute`` of every tool's example (what a call computes before ``spec.check`` validates and cuts it)."""

    def __init__(self, inspector: Inspector) -> None:
        self.inspector = inspector
        self._runs = {name: spec.execute(inspector, self.arguments(name)) for name, spec in TOOLS.items()}

    @staticmethod
    def arguments(name: str, detail: str = "full") -> Any:
        spec = TOOLS[name]
        return spec.parse({**spec.example, "detail": detail})

    def run(self, name: str) -> Any:
        """A fresh copy of the tool's run (``check`` states the placement on the report it is given, in place)."""
        return copy.deepcopy(self._runs[name])

    def replaying(self, spec: ToolSpec) -> ToolSpec:
        """``spec`` with its analysis replayed: parsing, checking and cutting are the tool's own."""
        expected = _without_detail(self.arguments(spec.name))

        def replay(inspector: Inspector, arguments: Any) -> Any:
            if _without_detail(arguments) != expected:
                raise AssertionError(f"{spec.name} replays its example only, not {arguments!r}")
            return self.run(spec.name)

        return dataclasses.replace(spec, run=replay)


def _without_detail(arguments: Any) -> dict[str, Any]:
    return {key: value for key, value in arguments.model_dump().items() if key != "detail"}
