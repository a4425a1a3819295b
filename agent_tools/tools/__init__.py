"""The product's API: every tool, declared once. Surfaces are generated from :data:`TOOLS`.

To add a tool: write ``agent_tools/tools/<name>.py`` with a ``SPEC = ToolSpec(...)`` and list the module here.
"""

from __future__ import annotations

from importlib import import_module

from agent_tools.tools.registry import ToolSpec

TOOL_MODULES = (
    "describe_model",
    "show_attention",
)


def _collect() -> dict[str, ToolSpec]:
    tools: dict[str, ToolSpec] = {}
    for name in TOOL_MODULES:
        spec = import_module(f"agent_tools.tools.{name}").SPEC
        for extra in getattr(import_module(f"agent_tools.tools.{name}"), "EXTRA_SPECS", ()):
            tools[extra.name] = extra
        tools[spec.name] = spec
    return tools


TOOLS: dict[str, ToolSpec] = _collect()
TOOL_NAMES: tuple[str, ...] = tuple(TOOLS)


def get_tool(name: str) -> ToolSpec:
    from agent_tools.errors import InvalidInputError

    if name not in TOOLS:
        raise InvalidInputError(f"unknown tool {name!r}; tools: {', '.join(TOOL_NAMES)}", field="tool")
    return TOOLS[name]
