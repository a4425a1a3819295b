"""LangChain surface: :class:`AttentionToolkit`, one ``StructuredTool`` per declared tool.

Each tool answers with ``response_format="content_and_artifact"``: the content is a concise text an LLM
reads (summary, top findings, key numbers), the artifact is the full validated pydantic report. Expected
failures (a layer out of range, an empty text, a model not on the allow-list, arguments that do not
validate) come back as a ``ToolMessage`` with ``status="error"`` whose text names what is valid, so an agent
can correct itself; anything else is a bug and raises.

    from langchain.agents import create_agent
    from agent_tools.surfaces.langchain import AttentionToolkit
    from agent_tools.prompts import system_prompt

    toolkit = AttentionToolkit()                      # the bundled default model; all tools
    agent = create_agent("openai:gpt-4.1-mini", toolkit.get_tools(), system_prompt=system_prompt())
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from langchain_core.tools import BaseTool, BaseToolkit, StructuredTool, ToolException
from pydantic import ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from agent_tools.errors import AttentionToolError, InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel, ModelPolicy
from agent_tools.placement import make_placement
from agent_tools.schemas import Report
from agent_tools.settings import DEFAULT_MEMORY_BUDGET, DEFAULT_MODEL
from agent_tools.surfaces import agent_input_model, concise_text, error_text, select_tools
from agent_tools.surfaces.portable import portable_schema, restore_omitted
from agent_tools.tools.registry import ToolSpec, format_validation_error

# The toolkit's fields that are make_placement's arguments, by the same names.
PLACEMENT_FIELDS = frozenset({"dtype", "device", "device_map", "max_memory", "offload_folder", "quantization"})


class AttentionToolException(ToolException):
    """The ``ToolException`` LangChain turns into an error ``ToolMessage``; keeps the original error."""

    def __init__(self, tool: str, error: AttentionToolError) -> None:
        super().__init__(error_text(tool, error))
        self.error = error


def make_tool(spec: ToolSpec, inspector: Inspector, *, strict: bool = False) -> StructuredTool:
    """One declared tool as a LangChain ``StructuredTool`` bound to ``inspector``.

    ``strict=True``: the tool's schema is the OpenAI strict form (a JSON schema: every property required, the
    optional ones nullable), so ``bind_tools(tools, strict=True)`` sends it as it is, and a ``null`` for an
    optional argument is read as "not given" before the tool's own validation.
    """
    input_model = agent_input_model(spec, inspector.policy)

    def run_tool(*args: Any, **kwargs: Any) -> tuple[str, Report]:
        try:
            if args:  # a bare string instead of an arguments object
                raise InvalidInputError(f"{spec.name} takes an object of named arguments, got {args[0]!r}")
            report = spec(inspector, restore_omitted(kwargs, input_model) if strict else kwargs)
        except AttentionToolError as exc:
            raise AttentionToolException(spec.name, exc) from exc
        except ValidationError as exc:  # arguments were validated already: this is a bug (e.g. a bad report)
            msg = f"{spec.name} failed validation inside the tool (a bug, not the caller's input): {exc}"
            raise RuntimeError(msg) from exc
        return concise_text(report), report

    def validation_message(error: ValidationError) -> str:
        message = format_validation_error(spec.name, error, model=spec.input_model)
        return error_text(spec.name, InvalidInputError(message))

    return StructuredTool.from_function(
        func=run_tool,
        name=spec.name,
        description=spec.description,
        args_schema=portable_schema(input_model, "openai-strict") if strict else input_model,
        response_format="content_and_artifact",
        handle_tool_error=True,
        handle_validation_error=validation_message,
        metadata={"attention_tool": spec.name, "output_model": spec.output_model.__name__},
    )


class AttentionToolkit(BaseToolkit):
    """The attention-explainer tools for a LangChain agent, sharing one inspector (policy, limits, artifacts).

    Args:
        model: the model reference the tools serve by default (the bundled default model when omitted).
        tools: the names of the tools to offer (all declared tools when omitted); unknown names are refused.
        allowed_models: the references an agent may pass as ``model``; default: the bundled models plus
            ``model``. ``["*"]`` allows any reference (only for a trusted, local user).
        artifact_dir: folder where tools may write PNG files; none = artifact files are refused.
        token_limit: refuse texts longer than this many tokens (default: the model's own limit).
        memory_budget: refuse calls estimated to hold more than this many bytes of attention maps.
        dtype, device, device_map, max_memory, offload_folder, quantization: where and in what precision the
            models load (see :func:`agent_tools.placement.make_placement`; e.g. ``dtype="bfloat16"``,
            ``device_map="auto"``). The operator's choice: no tool argument changes it.
        inspector: an existing inspector to share (its policy then wins over the options above).
        strict: give the tools OpenAI's strict schemas (for ``bind_tools(tools, strict=True)``): every argument
            required, the optional ones nullable, and a ``null`` read as the argument's default.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: str = Field(default=DEFAULT_MODEL, description="the model reference the tools serve by default")
    tools: list[str] | None = Field(default=None, description="the tools to offer; None = every declared tool")
    allowed_models: list[str] | None = None
    artifact_dir: Path | None = None
    token_limit: int | None = Field(default=None, ge=1)
    memory_budget: int = Field(default=DEFAULT_MEMORY_BUDGET, ge=1)
    dtype: str = "auto"
    device: str = "auto"
    device_map: str | None = None
    max_memory: str | dict[str | int, str] | None = None
    offload_folder: str | None = None
    quantization: str | None = None
    inspector: Inspector | None = None
    strict: bool = Field(
        default=False,
        description="OpenAI strict function calling: schemas in strict form, null for an optional argument = omitted",
    )

    _inspector: Inspector = PrivateAttr()

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            select_tools(value)  # raises naming the declared tools
        return value

    def model_post_init(self, context: Any, /) -> None:
        if self.inspector is not None:
            self._inspector = self.inspector
            return
        if self.allowed_models == ["*"]:
            policy = ModelPolicy(None, self.model)
        elif self.allowed_models is not None:
            policy = ModelPolicy(frozenset({*self.allowed_models, self.model}), self.model)
        else:
            policy = ModelPolicy.bundled_only(default=self.model)
        self._inspector = Inspector(
            policy=policy,
            token_limit=self.token_limit,
            memory_budget=self.memory_budget,
            artifact_dir=self.artifact_dir,
            placement=make_placement(**self.model_dump(include=set(PLACEMENT_FIELDS))),
        )

    @property
    def session(self) -> Inspector:
        """The inspector every tool of this toolkit calls."""
        return self._inspector

    def load(self) -> LoadedModel:
        """Load the default model now (otherwise the first tool call does)."""
        return self._inspector.model(None)

    def get_tools(self) -> list[BaseTool]:
        return [make_tool(spec, self._inspector, strict=self.strict) for spec in select_tools(self.tools)]
