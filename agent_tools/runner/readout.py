"""What a batched row keeps of its output: the few numbers a metric reads, taken on the device batch by batch.

A patched row's output is a block of logits, a whole vocabulary row per position kept (a Llama-3-8B's 128,256
entries: 0.5 MB a row in float32, 542 MB for patch_heads' 1,056 rows on that model). The metrics read a few entries
of it: two answer tokens' logits, and at most the top token and the log-sum-exp over the vocabulary (what a
probability needs) at the last position; or each position's next-token loss. A :data:`Readout` turns one batch's
(B, K, V) output into those numbers on the output's device, so only they outlive the batch: the block exists while
its batch runs and is never stacked over rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_tools.analysis.metrics import next_token_losses

# A long text's (positions, vocabulary) logits are read this many positions at a time wherever they go to float64
# (the attention-path gap, the ablation checks' losses and KL): a block's memory, and the time between checkpoints.
POSITIONS_PER_BLOCK = 256

Readout = Callable[[Tensor], tuple[Tensor, ...]]  # a batch's (B, K, V) output -> tensors with B rows each


@dataclass(frozen=True)
class LastPosition:
    """At the last position: the logits of ``tokens`` (B, k), the log-sum-exp over the vocabulary (B,), the top
    token's logit (B,) and the top token (B,), float32 on the output's device (a probability is
    ``exp(logit − log-sum-exp)``)."""

    tokens: tuple[int, ...]

    def __call__(self, output: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        last = output[:, -1].float()  # (B, V): one position of the batch
        chosen = last[:, list(self.tokens)]  # (B, k)
        top_logit, top = last.max(dim=-1)
        return chosen, torch.logsumexp(last, dim=-1), top_logit, top


def last_position(tokens: Sequence[int]) -> LastPosition:
    """The readout of a next-token metric over ``tokens`` (answer, wrong, ...)."""
    return LastPosition(tuple(int(t) for t in tokens))


@dataclass(frozen=True)
class PositionLosses:
    """Every position's next-token loss (B, T−1) (:func:`~agent_tools.analysis.metrics.next_token_losses` in
    float32), one row's (T, V) block at a time."""

    input_ids: Tensor  # (1, T)

    def __call__(self, output: Tensor) -> tuple[Tensor]:
        ids = self.input_ids.to(output.device)
        rows = [next_token_losses(row[None], ids, dtype=torch.float32)[0] for row in output]  # each (T−1,)
        return (torch.stack(rows),)


def pooled_hidden(output: Tensor) -> tuple[Tensor]:
    """(B, T, C) final hidden states (a model without a next-token head) -> (B, C) their mean over positions."""
    return (output.float().mean(1),)


def stacked(parts: Sequence[tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """Each batch's readout (tensors with that batch's rows) -> every tensor concatenated over the batches."""
    return tuple(torch.cat([part[k] for part in parts]) for k in range(len(parts[0])))
