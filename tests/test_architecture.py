"""The layers of docs/ARCHITECTURE.md hold: no import cycle among the package's modules, lazy imports included.

`lint-imports` (the contract in pyproject.toml, run by .ci/run) fails on an import that goes up a layer; this test
finds cycles inside a layer, which the layers contract cannot see.
"""

from __future__ import annotations

import pytest

grimp = pytest.importorskip("grimp")


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of a directed graph with more than one node (the cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back() -> None:
    built = grimp.build_graph("agent_tools", exclude_type_checking_imports=True)
    graph = {module: set(built.find_modules_directly_imported_by(module)) for module in built.modules}
    assert strongly_connected(graph) == []


def test_every_module_of_the_package_sits_in_a_layer_of_the_contract() -> None:
    """A module left out of the import contract would be free to import anything: every one must be listed."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parents[1]
    contract = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    listed = {name.strip() for layer in contract["layers"] for name in layer.replace("|", ":").split(":")}
    package = root / "agent_tools"
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in package.glob("*/__init__.py")}
    modules -= {"prompt_files"}  # installed from prompts/, no code
    assert modules - listed == set()
    assert listed - modules == set()
