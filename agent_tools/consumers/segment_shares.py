"""Segment shares of each answer step's attention, reduced as they come: what a prompt trace keeps per step.

Not a layer consumer: it is fed one (L, H, Tk) stack of rows per query (from
:class:`~agent_tools.consumers.last_row.LastRowConsumer`) and keeps only per-segment sums, so a long generation
never holds its rows. It knows segments only as a token → segment index (no prompt objects), so any pass that
can label its keys can use it. Rows are reduced where they are; the sums (L·H·S and Tk numbers) are kept on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from agent_tools.analysis.segments import segment_shares
from agent_tools.consumers.host import to_host


@dataclass
class SegmentAccumulator:
    """Reduces each step's (L, H, Tk) rows to segment shares at once; only these summaries are kept.

    Keys past the prompt (tokens the model wrote) belong to segment ``generated``; the ``sink`` segment is set
    aside when picking each step's most-read key.
    """

    segment_index: Tensor  # (T,) long: each prompt token's segment
    num_segments: int
    sink: int | None = None  # index of the sink segment, if any
    generated: int | None = None  # index of the segment for keys past the prompt, if any
    steps: int = 0
    head_shares: Tensor | None = None  # (L, H, S) summed over steps
    token_weights: Tensor | None = None  # (Tk_max,) summed over steps, mean over layers and heads
    step_shares: list[Tensor] = field(default_factory=list)  # (S,) per step
    step_top_keys: list[tuple[int, float]] = field(default_factory=list)

    @property
    def prompt_length(self) -> int:
        return int(self.segment_index.shape[0])

    def add(self, rows: Tensor) -> Tensor:
        """(L, H, Tk) one query's rows -> (S,) its shares (mean over layers and heads); accumulates."""
        index = to_host(self.segment_index)
        extra = rows.shape[-1] - self.prompt_length
        if extra > 0:
            assert self.generated is not None
            index = torch.cat([index, torch.full((extra,), self.generated, dtype=torch.long)])  # (Tk,) on the CPU
        shares = to_host(segment_shares(rows, index, self.num_segments))  # (L, H, S), reduced where the rows are
        tokens = to_host(rows.mean((0, 1)))  # (Tk,)
        self.head_shares = shares if self.head_shares is None else self.head_shares + shares
        self._add_token_weights(tokens)
        readable = tokens.clone()
        if self.sink is not None:
            readable[index == self.sink] = -1.0
        top = int(readable.argmax())
        self.step_top_keys.append((top, float(tokens[top])))
        self.steps += 1
        mean = shares.mean((0, 1))  # (S,)
        self.step_shares.append(mean)
        return mean

    def _add_token_weights(self, tokens: Tensor) -> None:
        """Sum (Tk,) weights whose length grows by one key per generated step."""
        if self.token_weights is None:
            self.token_weights = tokens
            return
        grown = self.token_weights.new_zeros(max(tokens.shape[0], self.token_weights.shape[0]))
        grown[: self.token_weights.shape[0]] += self.token_weights
        grown[: tokens.shape[0]] += tokens
        self.token_weights = grown

    def mean_head_shares(self) -> Tensor:
        assert self.head_shares is not None
        return self.head_shares / self.steps  # (L, H, S)

    def mean_token_weights(self) -> Tensor:
        assert self.token_weights is not None
        return self.token_weights / self.steps
