"""corpus_summary's arguments and report: the pydantic models an agent reads, with their descriptions."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from agent_tools.schemas import DetailInput, Report

DESCRIPTION = (
    "A corpus run's stable and variable heads or segment rates with confidence intervals, or what an allowed data "
    "file holds. Omit data to list them."
)
SummaryKind = Literal["list", "run", "data"]


class CorpusSummaryInput(DetailInput):
    data: str | None = Field(
        default=None,
        max_length=300,
        description="an allowed data file or run folder; omitted = list them",
    )
    top_k: int = Field(default=5, ge=1, le=50, description="rows listed per group")


class HeadEntry(BaseModel):
    head: str = Field(description="layer.head")
    role: str = Field(description="the head's most frequent role (profile) or collapse verdict (collapse)")
    share: float = Field(description="share of the items where the head takes that role")
    roles: dict[str, float] = Field(default_factory=dict, description="every role seen and its share (variable heads)")


class SegmentEntry(BaseModel):
    segment: str = Field(description="segment name (system#1, user#1, a named span, template, sink) or kind")
    items: int = Field(description="items having this segment")
    share: float | None = Field(description="mean share of the answer's attention on it (layers and heads)")
    share_ci: list[float | None] = Field(description="bootstrap 95% interval of that mean")
    read_most_rate: float | None = Field(description="share of those items whose answer read this segment most")
    read_most_ci: list[float | None] = Field(description="bootstrap 95% interval of that rate")


class DataFacts(BaseModel):
    items: int = Field(description="records read (at most the first 100,000)")
    text_items: int
    message_items: int
    unreadable: int = Field(description="records that cannot be analysed (malformed line, no text or messages)")
    roles: dict[str, int] = Field(description="messages per role, over the chat items")
    mean_characters: float
    max_characters: int
    problems: list[str] = Field(description="the first unreadable records and why")


class CorpusSummaryReport(Report):
    kind: SummaryKind = Field(description="list: what is allowed; run: a corpus run's summary; data: a data file")
    allowed: list[str] = Field(description="the data names this session may read")
    data: str | None = None
    task: str | None = Field(default=None, description="the run's task: profile, trace or collapse")
    complete: bool | None = Field(default=None, description="whether the run finished (False: stopped or running)")
    items: int | None = None
    analysed: int | None = None
    errors: int | None = None
    stable_count: int | None = Field(default=None, description="heads whose role holds on ≥ 80% of the items")
    variable_count: int | None = None
    stable_heads: list[HeadEntry] = Field(default_factory=list)
    variable_heads: list[HeadEntry] = Field(default_factory=list)
    segments: list[SegmentEntry] = Field(default_factory=list, description="trace runs: per segment name")
    kinds: list[SegmentEntry] = Field(default_factory=list, description="trace runs: per segment kind")
    data_facts: DataFacts | None = None
