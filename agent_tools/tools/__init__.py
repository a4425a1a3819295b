"""The product's API: every tool, declared once. Surfaces are generated from :data:`TOOLS`.

To add a tool: write a package ``agent_tools/tools/<name>/`` whose ``__init__`` defines ``SPEC = ToolSpec(...)``
(docs/ARCHITECTURE.md, "A tool"). Packages are discovered automatically; :data:`PREFERRED_ORDER` only orders the
listing.
"""

from __future__ import annotations

import pkgutil
from importlib import import_module

from agent_tools.errors import InvalidInputError
from agent_tools.tools.registry import ToolSpec

PREFERRED_ORDER = (
    "describe_model",
    "show_attention",
    "diagnose_collapse",
    "explain_scaling",
    "inspect_projections",
    "reconstruct_attention",
    "profile_heads",
    "ablate_heads",
    "trace_prompt_attention",
    "compare_prompts",
)
_NOT_TOOLS = {"registry"}


def _collect() -> dict[str, ToolSpec]:
    found: dict[str, ToolSpec] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in _NOT_TOOLS or info.name.startswith("_"):
            continue
        spec = getattr(import_module(f"{__name__}.{info.name}"), "SPEC", None)
        if isinstance(spec, ToolSpec):
            if spec.name in found:
                raise RuntimeError(f"tool {spec.name!r} declared twice")
            found[spec.name] = spec
    rank = {name: i for i, name in enumerate(PREFERRED_ORDER)}
    return dict(sorted(found.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


TOOLS: dict[str, ToolSpec] = _collect()
TOOL_NAMES: tuple[str, ...] = tuple(TOOLS)


def get_tool(name: str) -> ToolSpec:
    if name not in TOOLS:
        raise InvalidInputError(f"unknown tool {name!r}; tools: {', '.join(TOOL_NAMES)}", field="tool")
    return TOOLS[name]
