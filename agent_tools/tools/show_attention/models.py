"""show_attention's arguments and report: the pydantic models an agent reads, with their descriptions."""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent_tools.schemas import KeyWeight, Report, TextInput, Token

DESCRIPTION = (
    "Show what one attention head reads on a text: for every query token its top keys with weights, the "
    "entropy of each row and of the head, the most-read token, and optionally the full map or a PNG heatmap."
)


class ShowAttentionInput(TextInput):
    layer: int = Field(description="layer index, 0-based (describe_model gives the range)")
    head: int = Field(description="query head index, 0-based")
    top_k: int = Field(default=3, ge=1, le=20, description="keys listed per query")
    include_map: bool = Field(default=False, description="return the full query × key weight matrix (T² numbers)")
    png: bool = Field(default=False, description="write the map as a PNG heatmap into the session's artifact folder")


class QueryRow(BaseModel):
    position: int
    token: str
    entropy: float = Field(description="entropy of this query's weights, nats")
    top_keys: list[KeyWeight]


class AttentionView(Report):
    layer: int
    head: int
    kv_head: int = Field(description="the KV head this query head reads (grouped-query attention)")
    tokens: list[Token]
    rows: list[QueryRow]
    mean_entropy: float = Field(description="mean entropy over queries, nats")
    mean_normalised_entropy: float = Field(description="mean of entropy / log(keys visible), 0 = one key, 1 = uniform")
    weights: list[list[float]] | None = Field(default=None, description="the full map (queries × keys), when asked")
    png_path: str | None = None
