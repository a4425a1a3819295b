"""find_circuit's arguments and report: edge attribution (EAP-IG) between a clean and a corrupted prompt."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from agent_tools.schemas import ModelInput, Report, Rounded

DESCRIPTION = "Use for the circuit of an answer: which head reads which (Q/K/V); EAP-IG, clean/corrupted pair"
DEFAULT_STEPS = 5
EdgeKind = Literal["Q", "K", "V", "direct"]
NodeKind = Literal["embeddings", "head", "kv_head", "logits"]
Ranking = Literal["|score|", "score", "paths"]


class FindCircuitInput(ModelInput):
    clean: str
    corrupted: str
    answer: str | None = None  # one token ('' is refused as 0 tokens); omitted = the clean top token
    wrong: str | None = None
    target: float = Field(default=0.8, ge=0.05, le=1.0, description="faithfulness the circuit must reach")
    steps: int = Field(
        default=DEFAULT_STEPS, ge=1, le=16, description="interpolation steps of the integrated gradients"
    )
    max_edges: int = Field(default=40, ge=1, le=60, description="most edges in the returned graph")
    png: bool = Field(default=False, description="write the graph as PNG and HTML (artifacts)")


class CircuitNode(BaseModel):
    name: str = Field(description="embeddings, logits, LxHy (a head) or LxKVg (a KV head shared by query heads)")
    kind: NodeKind
    layer: int | None = None
    heads: list[int] = Field(default_factory=list, description="the query heads this node stands for")


class CircuitEdge(BaseModel):
    sender: str
    receiver: str
    kind: EdgeKind = Field(description="the receiver's input the sender is read through; direct: the logits")
    score: Rounded = Field(
        description="EAP-IG estimate / (LD_clean − LD_corrupted): the share of the logit difference this edge "
        "carries to first order (integrated); positive toward the clean answer"
    )
    in_circuit: bool = Field(description="false: listed only for its |score| above the threshold")
    sentence: str


class CurvePoint(BaseModel):
    edges: int
    heads: int = Field(description="heads kept clean: the endpoints of the ranked edge set")
    faithfulness: Rounded = Field(description="(LD − LD_corrupted) / (LD_clean − LD_corrupted) with this edge set")
    random_mean: Rounded = Field(description="the same for random edge sets of this size (mean over draws)")
    random_spread: Rounded = Field(description="their standard deviation")


class CircuitReport(Report):
    tokens: int
    answer: str
    wrong: str
    logit_difference_clean: Rounded
    logit_difference_corrupted: Rounded
    steps: int = Field(description="interpolation steps (midpoints α = (k + ½)/steps), one batched backward")
    gradient_dtype: str
    faithfulness_method: str = Field(description="how faithfulness is measured")
    edges_scored: int = Field(description="edges scored (every sender before every receiver)")
    target: float
    reached: bool
    ranking: Ranking = Field(
        description="the edge order pruned: by |score|, by score (toward the clean answer first), or by paths "
        "(whole paths from the embeddings to the logits, widest first); all are tried, the one reaching the "
        "target with fewer edges is kept"
    )
    circuit_edges: int = Field(description="edges in the smallest ranked set reaching the target (or all tried)")
    faithfulness: Rounded
    empty_circuit: Rounded = Field(description="faithfulness with no edge (every head corrupted)")
    random_draws: int
    threshold: float = Field(description="edges with |score| below this share of the gap are not listed")
    nodes: list[CircuitNode]
    edges: list[CircuitEdge]
    curve: list[CurvePoint]
    png_path: str | None = Field(default=None, description="the graph as a PNG (with png)")
    html_path: str | None = Field(default=None, description="the graph as inline SVG with the edge table (with png)")
