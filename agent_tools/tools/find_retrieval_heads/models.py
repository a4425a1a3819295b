"""find_retrieval_heads' arguments and report."""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent_tools.long_context import DEFAULT_ANSWER, DEFAULT_NEEDLE, DEFAULT_QUESTION
from agent_tools.schemas import HeadRow, ModelInput, Report, Rounded

DESCRIPTION = (
    "Heads that fetch from far back: needle-in-a-haystack at several depths and lengths, a retrieval score per "
    "head, the top ablated vs random. Use for long context."
)


class FindRetrievalHeadsInput(ModelInput):
    text: str | None = Field(default=None, description="the haystack, repeated to fill; omitted = a built-in one")
    needle: str = Field(default=DEFAULT_NEEDLE, description="the sentence hidden")
    answer: str = Field(default=DEFAULT_ANSWER, description="the part of the needle to copy back")
    question: str = Field(default=DEFAULT_QUESTION, description="asked after the haystack")
    depths: list[float] = Field(
        default=[0.1, 0.3, 0.5, 0.7, 0.9], min_length=1, max_length=11, description="0 = start, 1 = end"
    )
    lengths: list[int] = Field(default=[256, 512], min_length=1, max_length=4, description="tokens")
    top_k: int = Field(default=5, ge=1, le=50, description="top heads ablated together")
    random_draws: int = Field(default=3, ge=1, le=20, description="random sets of as many heads")
    seed: int = Field(default=0, description="seed of the random head draws")


class RetrievalHead(HeadRow):
    score: Rounded = Field(description="mean retrieval score over every depth and length, 0..1")
    score_sd: Rounded = Field(description="standard deviation of the score over depths and lengths")
    score_min: Rounded
    score_max: Rounded


class Haystack(BaseModel):
    length: int
    depth: float
    needle_start: int = Field(description="token position where the needle starts")
    accuracy: Rounded = Field(description="share of answer tokens the model predicts (teacher forced), full model")
    top_head_score: Rounded = Field(description="the best head's retrieval score on this haystack")


class CausalCheck(BaseModel):
    ablated: list[str] = Field(description='the top heads ablated together, as "L.H" (mean ablation)')
    accuracy_clean: Rounded = Field(description="answer-token accuracy over every haystack, full model")
    accuracy_top_ablated: Rounded
    accuracy_random_mean: Rounded = Field(description="the same with random heads of the same count ablated, mean")
    accuracy_random_sd: Rounded = Field(description="… and its sample standard deviation (n − 1) over the draws")
    random_draws: int
    logprob_clean: Rounded = Field(description="mean log-probability of the answer tokens, full model")
    logprob_top_ablated: Rounded
    logprob_random_mean: Rounded
    verdict: str = Field(description="what the check says, with its baseline")


class FindRetrievalHeadsReport(Report):
    method: str = Field(description="how the score is computed and what it does not say")
    haystacks: list[Haystack]
    heads: list[RetrievalHead] = Field(description="heads with a non-zero score, best first")
    layer_scores: list[Rounded] = Field(description="per layer, the largest head score")
    score_grid: list[list[float]] = Field(description="layer x head mean retrieval scores (for a picture)")
    causal: CausalCheck
