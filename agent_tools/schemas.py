"""Pydantic building blocks shared by every report: plain numbers, token strings with positions, findings.

Tensors never reach these models; numbers are rounded for reading.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

DIGITS = 4


def rounded(value: float, digits: int = DIGITS) -> float:
    """Round for reading; NaN and inf are kept as they are, never hidden."""
    value = float(value)
    if not math.isfinite(value):
        return value
    return round(value, digits)


class ToolInput(BaseModel):
    """Base of every tool's input: unknown arguments are refused, strings are stripped of nothing."""

    model_config = ConfigDict(extra="forbid")


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
    summary: str = Field(description="two or three sentences an agent can say, citing layer, head, token, value")
    findings: list[Finding] = Field(default_factory=list)

    def short_text(self, limit: int = 1200) -> str:
        """The concise text an LLM reads (summary plus the top findings)."""
        lines = [self.summary]
        for finding in self.findings[:6]:
            lines.append(f"- {finding.detail}")
        text = "\n".join(lines)
        return text if len(text) <= limit else text[: limit - 1] + "…"


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
