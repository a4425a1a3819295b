"""show_attention's arguments and report: the pydantic models an agent reads, with their descriptions."""

from __future__ import annotations

from pydantic import Field

from agent_tools.schemas import KeyWeight, Report, Rounded, Rounded6, TextInput, Token, TokenRow
from agent_tools.stack_input import StackInput, StackReport

DESCRIPTION = (
    "What one head reads on a text: each query's top keys and weights, entropy, the most-read token. Use to look "
    "at a named head."
)


class ShowAttentionInput(TextInput, StackInput):
    layer: int
    head: int
    top_k: int = Field(default=3, ge=1, le=20, description="keys listed per query")
    include_map: bool = Field(default=False, description="add the full T×T weight map")
    png: bool = Field(default=False, description="write a PNG heatmap (artifact)")


class QueryRow(TokenRow):
    entropy: Rounded = Field(description="entropy of this query's weights, nats")
    top_keys: list[KeyWeight]


class AttentionView(Report, StackReport):
    layer: int
    head: int
    kv_head: int = Field(description="the KV head this query head reads (grouped-query attention)")
    tokens: list[Token]
    rows: list[QueryRow]
    mean_entropy: Rounded = Field(description="mean entropy over queries, nats")
    mean_normalised_entropy: Rounded = Field(
        description="mean of entropy / log(keys visible), 0 = one key, 1 = uniform"
    )
    weights: list[list[Rounded6]] | None = Field(default=None, description="the full map (queries × keys), when asked")
    png_path: str | None = None
