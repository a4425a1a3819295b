"""Pydantic building blocks shared by every report: plain numbers, token strings with positions, findings.

Tensors never reach these models; numbers are rounded for reading.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

DIGITS = 4


def rounded(value: float, digits: int = DIGITS) -> float:
    """Round for reading; NaN and inf are kept as they are, never hidden."""
    value = float(value)
    if not math.isfinite(value):
        return value
    return round(value, digits)


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


class ToolInput(BaseModel):
    """Base of every tool's input: unknown arguments are refused, strings are stripped of nothing, and a boolean
    is never read as a number (pydantic's lax mode would take ``"layer": true`` as layer 1)."""

    model_config = ConfigDict(extra="forbid")

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


def _role_schema(schema: dict[str, Any]) -> None:
    """Advertise ``role`` as a plain string, as the tools' input schemas always have (validation still refuses
    other roles, naming the allowed ones)."""
    schema.pop("enum", None)


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="forbid")

    role: Role = Field(description="system, user or assistant", json_schema_extra=_role_schema)
    content: str = Field(description="the message text (not empty)")

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


class Finding(BaseModel):
    """One piece of evidence: where (layer, head, token) and how much (value)."""

    kind: str = Field(description="what was found, e.g. 'sink', 'collapse', 'previous_token'")
    layer: int | None = None
    head: int | None = None
    position: int | None = Field(default=None, description="token position the finding is about")
    token: str | None = None
    value: float | None = Field(default=None, description="the measured number behind the finding")
    detail: str = Field(description="one sentence an agent can quote")


class Report(BaseModel):
    """Every tool's output: the model it ran on, a short summary for an agent, and the evidence."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the model reference the tool ran on")
    dtype: str | None = Field(default=None, description="the precision the model ran in, e.g. float32, bfloat16")
    device: str | None = Field(
        default=None, description="where it ran (cpu, cuda:0, ...; a sharded model's input device)"
    )
    summary: str = Field(description="two or three sentences an agent can say, citing layer, head, token, value")
    findings: list[Finding] = Field(default_factory=list)

    def short_text(self, limit: int = 1200) -> str:
        """The concise text an LLM reads (summary plus the top findings)."""
        lines = [self.summary]
        for finding in self.findings[:6]:
            lines.append(f"- {finding.detail}")
        text = "\n".join(lines)
        return text if len(text) <= limit else text[: limit - 1] + "…"

    def _repr_html_(self) -> str:
        """Jupyter: the summary, the key figure and the findings (drawn by :mod:`agent_tools.report.notebook_view`)."""
        from agent_tools.report.notebook_view import report_html

        return report_html(self)

    def _repr_markdown_(self) -> str:
        """Text front-ends: the summary, the key figure's numbers and the findings, as Markdown."""
        from agent_tools.report.notebook_view import report_markdown

        return report_markdown(self)


def jsonable(report: BaseModel) -> dict[str, Any]:
    return report.model_dump(mode="json")


MODEL_FIELD_DESCRIPTION = (
    "model to inspect: a bundled alias (smollm2-135m-instruct, minilm-l6), a local folder or .gguf file, "
    "or a hub id; omitted = the session's default"
)
TEXT_FIELD_DESCRIPTION = "the text to run through the model (plain text; not empty)"


class ModelInput(ToolInput):
    model: str | None = Field(default=None, description=MODEL_FIELD_DESCRIPTION, max_length=500)


class TextInput(ModelInput):
    text: str = Field(description=TEXT_FIELD_DESCRIPTION)


class KeyWeight(BaseModel):
    position: int
    token: str
    weight: float
