"""LangChain's own standard tool tests (``langchain-tests``) for every declared tool.

``ToolsUnitTests`` run on the toolkit an agent gets by default (the bundled models; nothing loads);
``ToolsIntegrationTests`` invoke each tool four times (sync and async, with and without a ``ToolCall``), so
they run on the tiny random-weight Llama with each tool's example moved onto it: the real default model would
take about 8 s per round of the fourteen tools on this machine.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from langchain_core.tools import BaseTool
from langchain_tests.integration_tests import ToolsIntegrationTests
from langchain_tests.unit_tests import ToolsUnitTests
from tiny_calls import TINY, tiny_arguments

from agent_tools.loading import LoadedModel
from agent_tools.surfaces.langchain import AttentionToolkit
from agent_tools.tools import TOOLS

DEFAULT_TOOLS = {tool.name: tool for tool in AttentionToolkit().get_tools()}


class PerTool:
    """Runs the standard suite once per declared tool: ``name`` is set before each test by a parametrized
    fixture, and the properties the suite reads follow it."""

    name: str
    tools: dict[str, BaseTool]
    examples: dict[str, dict[str, Any]]

    @pytest.fixture(autouse=True, params=list(TOOLS))
    def _each_tool(self, request: pytest.FixtureRequest) -> None:
        self.name = request.param

    @property
    def tool_constructor(self) -> BaseTool:
        return self.tools[self.name]

    @property
    def tool_invoke_params_example(self) -> dict[str, Any]:
        return self.examples[self.name]


class TestAttentionToolsUnit(PerTool, ToolsUnitTests):
    tools: ClassVar[dict[str, BaseTool]] = DEFAULT_TOOLS
    examples: ClassVar[dict[str, dict[str, Any]]] = {name: dict(spec.example) for name, spec in TOOLS.items()}


STRICT_TOOLS = {tool.name: tool for tool in AttentionToolkit(strict=True).get_tools()}


def strict_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The arguments as a strict model sends them: every property of the strict schema, null where not given."""
    schema = STRICT_TOOLS[name].args_schema
    assert isinstance(schema, dict)
    return {key: arguments.get(key) for key in schema["properties"]}


class TestAttentionToolsStrictUnit(PerTool, ToolsUnitTests):
    """The strict toolkit (OpenAI strict schemas as JSON) passes the same suite, with strict-style examples."""

    tools: ClassVar[dict[str, BaseTool]] = STRICT_TOOLS
    examples: ClassVar[dict[str, dict[str, Any]]] = {name: strict_call(name, s.example) for name, s in TOOLS.items()}


class TestAttentionToolsIntegration(PerTool, ToolsIntegrationTests):
    pytestmark = pytest.mark.anyio

    @pytest.fixture(autouse=True)
    def _on_tiny_model(self, _each_tool: None, tiny_models: dict[str, LoadedModel], tmp_path) -> None:
        toolkit = AttentionToolkit(model=TINY, allowed_models=[TINY], artifact_dir=tmp_path)
        self.tools = {tool.name: tool for tool in toolkit.get_tools()}
        self.examples = {self.name: tiny_arguments(self.name, tiny_models["llama"])}


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"
