"""Pydantic building blocks shared by every report: plain numbers, token strings with positions, findings.

Tensors never reach these models; numbers are rounded for reading.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

DIGITS = 4


def rounded(value: float, digits: int = DIGITS) -> float:
    """Round for reading; NaN and inf are kept as they are, never hidden."""
    value = float(value)
    if not math.isfinite(value):
        return value
    return round(value, digits)


Rounded = Annotated[float, AfterValidator(rounded)]
"""A report number rounded for reading (4 decimals) when the report is built: analysis keeps full precision, the
report boundary rounds once (declare the field ``Rounded``; never call :func:`rounded` to fill it)."""
Rounded2 = Annotated[float, AfterValidator(partial(rounded, digits=2))]
"""A report number rounded to 2 decimals (angles in degrees)."""
Rounded6 = Annotated[float, AfterValidator(partial(rounded, digits=6))]
"""A report number rounded to 6 decimals (scales, temperatures and bounds whose 5th decimal matters)."""


def head_label(layer: int, head: int) -> str:
    """How reports name a head: ``"layer.head"`` (e.g. ``"18.8"``), the form ``ablate_heads`` accepts."""
    return f"{layer}.{head}"


def mentions(annotation: Any, kinds: tuple[type, ...], _seen: frozenset[type] = frozenset()) -> bool:
    """Whether values of one of ``kinds`` can appear anywhere in this annotation (unions, lists, nested models)."""
    if isinstance(annotation, type) and issubclass(annotation, kinds):
        return True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation in _seen:
            return False
        seen = _seen | {annotation}
        return any(mentions(f.annotation, kinds, seen) for f in annotation.model_fields.values())
    return any(mentions(arg, kinds, _seen) for arg in get_args(annotation) if not isinstance(arg, str | int | float))


def holds_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, list | tuple):
        return any(holds_bool(v) for v in value)
    if isinstance(value, dict):
        return any(holds_bool(v) for v in value.values())
    return False


def omittable(node: Any) -> Any:
    """A JSON schema with every optional property whose default is ``null`` reduced to its non-null form: the
    ``{"type": "null"}`` branch and the ``"default": null`` dropped (required properties are left as they are)."""
    if isinstance(node, list):
        return [omittable(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: omittable(value) for key, value in node.items()}
    properties = out.get("properties")
    if isinstance(properties, dict):
        out["properties"] = {name: _without_null(schema) for name, schema in properties.items()}
    return out


def _without_null(schema: Any) -> Any:
    if not isinstance(schema, dict) or "default" not in schema or schema["default"] is not None:
        return schema
    variants = [v for v in schema.get("anyOf", ()) if v != {"type": "null"}]
    rest = {k: v for k, v in schema.items() if k not in ("anyOf", "default")}
    if "anyOf" not in schema:
        return rest
    return {**variants[0], **rest} if len(variants) == 1 else {"anyOf": variants, **rest}


class ToolInput(BaseModel):
    """Base of every argument object (a tool's input derives from :class:`DetailInput`): unknown arguments are
    refused, strings are stripped of nothing, and a boolean is never read as a number (pydantic's lax mode
    would take ``"layer": true`` as layer 1)."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Pydantic's schema with each argument that may be omitted (``X | None = None``) written as ``X``: leaving
        it out is how to say "not given", so ``null`` and ``"default": null`` only cost an agent's tokens (strict
        forms add the ``null`` back, see :mod:`agent_tools.surfaces.portable`)."""
        schema = omittable(super().model_json_schema(*args, **kwargs))
        for definition in schema.get("$defs", {}).values():  # a nested model's docstring: its property says it
            definition.pop("description", None)
        schema.pop("description", None)  # the class docstring: the tool's own description says what it takes
        if set(cls.model_fields) - set(schema.get("properties", {})):
            # Arguments accepted but left out of the schema (a tool's advanced ones, see agent_input_model): a
            # closed schema would refuse calls the tool takes, so it stays open; unknown names are still refused
            # by validation, which names the valid ones.
            schema.pop("additionalProperties", None)
        return schema

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: Any) -> Any:
        if holds_bool(value):
            field = cls.model_fields.get(info.field_name) if info.field_name else None
            annotation = field.annotation if field is not None else None
            if mentions(annotation, (int, float)) and not mentions(annotation, (bool,)):
                raise PydanticCustomError("bool_not_number", "Input should be a number, not a boolean")
        return value


Role = Literal["system", "user", "assistant"]
ROLES: tuple[str, ...] = get_args(Role)


class ChatMessage(BaseModel):
    """One chat message (its schema is the enum of roles and a string: the names say the rest)."""

    model_config = ConfigDict(extra="forbid")

    role: Role
    content: str

    @field_validator("role", mode="before")
    @classmethod
    def _allowed_role(cls, value: Any) -> Any:
        """Name the allowed roles in the error (pydantic's own message would too, less plainly)."""
        if isinstance(value, str) and value not in ROLES:
            context = {"role": repr(value), "roles": ", ".join(ROLES)}
            raise PydanticCustomError("role_not_allowed", "role {role} is not allowed; allowed roles: {roles}", context)
        return value


class Token(BaseModel):
    position: int = Field(description="0-based index in the token sequence")
    text: str = Field(description="the token as text (decoded on its own)")
    token_id: int = Field(description="vocabulary id")
    special: bool = Field(default=False, description="a special token such as BOS, [CLS], [SEP] or a chat marker")


Severity = Literal["high", "medium", "low"]
SEVERITIES: tuple[str, ...] = get_args(Severity)  # most important first: the concise text drops from the end


class Finding(BaseModel):
    """One piece of evidence: where (layer, head, token) and how much (value)."""

    kind: str = Field(description="what was found, e.g. 'sink', 'collapse', 'previous_token'")
    severity: Severity = Field(
        default="medium", description="high: what the summary leads with; low: context (dropped first when short)"
    )
    layer: int | None = None
    head: int | None = None
    position: int | None = Field(default=None, description="token position the finding is about")
    token: str | None = None
    value: float | None = Field(default=None, description="the measured number behind the finding")
    detail: str = Field(description="one sentence an agent can quote")


class NextCall(BaseModel):
    """A follow-up call with its arguments, drawn from the report's own results: runnable as written."""

    tool: str
    arguments: dict[str, Any]
    why: str = Field(description="what the call would confirm or refute")


MAX_NEXT_CALLS = 3


def follow_up(tool: str, arguments: dict[str, Any], why: str, *, model: str | None = None) -> NextCall:
    """A next call; ``model`` (the one the caller named, if any) goes first so the call runs on the same model."""
    return NextCall(tool=tool, arguments=({"model": model} if model else {}) | arguments, why=why)


class Omitted(BaseModel):
    """A list that ``detail: "summary"`` cut to its most important rows."""

    field: str = Field(description="the list, as a path in the report ('[]': in every row of a list)")
    kept: int
    total: int
    order: str = Field(description="how the kept rows were chosen and are ordered, most important first")
    cutoff: float | None = Field(
        default=None, description="the most important value among the rows left out (by that order)"
    )


class AttentionPath(BaseModel):
    """Which attention path a report explains, and the measured gap to the model's default path on this text."""

    model_config = ConfigDict(extra="forbid")

    explained: str = Field(description="the path the maps and numbers come from: the families' eager attention")
    model_default: str = Field(description="the implementation the model runs by default (sdpa, eager, ...)")
    tokens: int | None = Field(default=None, description="positions compared (None: no text ran, or same path)")
    max_output_difference: float | None = Field(
        default=None, description="largest |eager − default| of the output logits (hidden states without a head)"
    )
    mean_kl: float | None = Field(
        default=None, description="mean KL(eager ‖ default) of the next-token distributions, nats"
    )
    max_kl: float | None = Field(default=None, description="largest per-position KL(eager ‖ default), nats")
    top1_agreement: float | None = Field(
        default=None, description="share of positions where both paths predict the same next token"
    )


class Report(BaseModel):
    """Every tool's output: the model it ran on, a short summary for an agent, and the evidence."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the model reference the tool ran on")
    dtype: str | None = Field(default=None, description="the precision the model ran in, e.g. float32, bfloat16")
    device: str | None = Field(
        default=None, description="where it ran (cpu, cuda:0, ...; a sharded model's input device)"
    )
    attention_path: AttentionPath | None = Field(
        default=None, description="the attention path explained and its measured gap to the model's default path"
    )
    summary: str = Field(description="two or three sentences an agent can say, citing layer, head, token, value")
    findings: list[Finding] = Field(default_factory=list)
    next_calls: list[NextCall] = Field(
        default_factory=list, max_length=MAX_NEXT_CALLS, description="up to three follow-up calls, with arguments"
    )
    omitted: list[Omitted] = Field(
        default_factory=list, description="lists cut by detail 'summary' (empty with detail 'full')"
    )

    def _repr_html_(self) -> str:
        """Jupyter: the registered renderer's HTML (the summary, key figure and findings), else the plain summary."""
        render = NOTEBOOK_RENDERERS.get("html")
        if render is None:
            return f"<p>{html.escape(self.summary)}</p>"
        return render(self)

    def _repr_markdown_(self) -> str:
        """Text front-ends: the registered renderer's Markdown, else the summary and findings."""
        render = NOTEBOOK_RENDERERS.get("markdown")
        if render is None:
            return "\n".join([self.summary, *(f"- {f.detail}" for f in self.findings)])
        return render(self)


NotebookFormat = Literal["html", "markdown"]
NOTEBOOK_RENDERERS: dict[str, Callable[[Report], str]] = {}
"""How reports draw themselves in notebooks, filled by the layer that draws (:mod:`agent_tools.report.notebook_view`
registers on import), so this base layer imports nothing above it."""


def register_notebook_renderer(fmt: NotebookFormat, render: Callable[[Report], str]) -> None:
    """Make ``render`` draw every :class:`Report` as ``fmt`` in Jupyter (``_repr_html_`` / ``_repr_markdown_``)."""
    NOTEBOOK_RENDERERS[fmt] = render


Detail = Literal["summary", "full"]
DETAILS: tuple[str, ...] = get_args(Detail)


def _said_in_the_prompts(schema: dict[str, Any]) -> None:
    """A shared argument's schema without its default: the prompts say it once for every tool."""
    schema.pop("default", None)


class DetailInput(ToolInput):
    """Base of every tool's arguments: ``detail``, how much of the report to return (one definition for all).

    Its schema is the enum alone (every tool has it): what the values mean and that "summary" is the default are
    said once, in the prompts' "Arguments" (``prompts/mcp_instructions.md``, ``prompts/system.md``), and a report
    cut by "summary" says in its text that ``detail='full'`` returns every row."""

    detail: Detail = Field(default="summary", json_schema_extra=_said_in_the_prompts)


class ModelInput(DetailInput):
    model: str | None = Field(
        default=None,
        description="model to inspect: a bundled alias (smollm2-135m-instruct, minilm-l6), a local folder or .gguf "
        "file, or a hub id; omitted = the session's default",
        max_length=500,
    )


class TextInput(ModelInput):
    text: str  # what a text is, said once in the prompts (prompts/mcp_instructions.md "Arguments")


def text_follow_up(args: TextInput, tool: str, arguments: dict[str, Any], why: str) -> NextCall:
    """A next call on the same text and model as the call ``args`` made (:func:`follow_up` with ``text`` first)."""
    return follow_up(tool, {"text": args.text} | arguments, why, model=args.model)


class HeadRow(BaseModel):
    """Base of a report row about one head: its layer and head, the row's first fields."""

    layer: int
    head: int


class TokenRow(BaseModel):
    """Base of a report row about one token: its position and text, the row's first fields."""

    position: int
    token: str


class KeyWeight(TokenRow):
    weight: Rounded
