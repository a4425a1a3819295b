"""Causal checks for heads, sized against chance: the same ablation on random heads, batched as rows of one forward.

``ablate_heads`` and ``diagnose_collapse`` both ask "does removing these heads change the model's predictions more
than removing as many random heads would?". Here: the resample source (another text of the same length, or the
text's own tokens in a seeded random order, said in words), and :func:`measure_head_sets`, which runs every head
set × method as a row of a batched forward (:meth:`Inspector.ablated_rows`) and keeps, per row, the mean
next-token loss and KL against the clean run (a causal LM) or the pooled embedding's 1 − cos (an encoder).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_tools.analysis.ablation import cosine_change, derangement, draw_head_sets
from agent_tools.analysis.metrics import Baseline, kl_divergence, next_token_losses
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Encoded, Inspector
from agent_tools.intervene import AblationMethod
from agent_tools.loading import LoadedModel
from agent_tools.runner import HeadSetAblation, head_outputs, mean_head_outputs
from agent_tools.runner.readout import POSITIONS_PER_BLOCK
from agent_tools.session import call_checkpoint, guarded

HeadSet = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ResampleSource:
    """What resample ablation copies heads' outputs from: (1, T) ids, or None when there is nothing to use."""

    ids: Tensor | None
    description: str  # said in the report, e.g. "the text's own tokens in a seeded random order (seed 0)"


def resample_source(
    inspector: Inspector, loaded: LoadedModel, encoded: Encoded, resample_text: str | None, *, seed: int
) -> ResampleSource:
    """``resample_text``'s first T tokens (an error when it has fewer), else the text's own tokens moved by a seeded
    derangement (special tokens such as <bos> stay in place), else None with the reason."""
    length = encoded.length
    if resample_text is not None:
        other = inspector.encode(loaded, resample_text)
        if other.length < length:
            msg = (
                f"resample_text is {other.length} tokens; resample ablation takes the heads' outputs from a text of "
                f"the same length, so it needs at least {length} tokens (the text's length; longer is cut)"
            )
            raise InvalidInputError(msg, field="resample_text")
        return ResampleSource(other.input_ids[:, :length], f"the first {length} tokens of resample_text")
    fixed = [t.position for t in encoded.tokens if t.special]
    order = derangement(length, fixed, seed=seed)
    if order is None:
        return ResampleSource(
            None,
            f"no resample source: the text has fewer than 2 tokens that could be shuffled; give resample_text "
            f"({length} tokens or more)",
        )
    kept = " (special tokens kept in place)" if fixed else ""
    return ResampleSource(
        encoded.input_ids[:, order], f"the text's own tokens in a seeded random order (seed {seed}){kept}"
    )


@dataclass(frozen=True)
class SetEffect:
    """One head set × method: the change it makes to the model's output on the text (plain floats)."""

    heads: HeadSet
    method: AblationMethod
    loss_change: float | None  # mean next-token loss, ablated − clean (nats; None for an encoder)
    kl_mean: float | None  # mean over positions of KL(clean ‖ ablated), nats (None for an encoder)
    cosine_change: float | None  # encoder: 1 − cos of the mean-pooled output, clean vs ablated

    @property
    def effect(self) -> float:
        """The signed effect a verdict is judged on: the loss change (LM) or the embedding's 1 − cos (encoder)."""
        value = self.loss_change if self.loss_change is not None else self.cosine_change
        return float(value if value is not None else 0.0)


@dataclass(frozen=True)
class MeasuredSets:
    """Every row's effect (in the order asked), the clean loss, and the cost in forward-pass equivalents."""

    effects: list[SetEffect]
    loss_clean: float | None
    forward_equivalents: float  # recording passes + the clean row + Σ over rows of the layers each row ran / L


def measure_head_sets(
    inspector: Inspector,
    loaded: LoadedModel,
    encoded: Encoded,
    rows: Sequence[tuple[HeadSet, AblationMethod]],
    resample: ResampleSource | None,
) -> MeasuredSets:
    """Run every (head set, method) as a row of a batched forward over the text; resample rows need ``resample``.

    Mean ablation replaces a head's output by its mean over the text's positions (one recording pass);
    resample ablation by its output on the resample source at the same position (one more recording pass).
    """
    facts = loaded.facts
    methods = {method for _, method in rows}
    layers = sorted({layer for heads, _ in rows for layer, _ in heads})
    replacements: dict[AblationMethod, dict[int, Tensor]] = {}
    recordings = 0
    if "mean" in methods:
        with guarded(loaded):
            replacements["mean"] = mean_head_outputs(loaded, encoded.input_ids, layers)
        recordings += 1
    if "resample" in methods:
        if resample is None or resample.ids is None:
            raise ValueError("resample rows need a resample source")
        with guarded(loaded):
            replacements["resample"] = head_outputs(loaded, resample.ids, layers)
        recordings += 1
    ids = encoded.input_ids
    logits = facts.is_language_model and not facts.is_encoder_decoder  # else the encoder's hidden states

    def reduce(output: Tensor) -> tuple[Tensor, ...]:
        if logits:
            batch = output.shape[0]
            losses = stepped_losses(output, ids).mean(-1) if ids.shape[-1] > 1 else output.new_zeros(batch)
            kl = stepped_kl(output[:1], output).mean(-1)  # (B,)
            return losses.double().cpu(), kl.double().cpu()
        pooled = output.double().mean(1)  # (B, C)
        return (cosine_change(pooled[:1], pooled).cpu(),)

    plan = [HeadSetAblation(heads, method) for heads, method in rows]
    clean, found = inspector.ablated_rows(loaded, ids, plan, replacements=replacements, reduce=reduce)
    language_model = len(clean) == 2
    effects = []
    for index, (heads, method) in enumerate(rows):
        if language_model:
            loss = float(found[0][index] - clean[0]) if ids.shape[-1] > 1 else None
            effects.append(SetEffect(heads, method, loss, float(found[1][index]), None))
        else:
            effects.append(SetEffect(heads, method, None, None, float(found[0][index])))
    layers_run = sum(facts.num_layers - min(layer for layer, _ in heads) for heads, _ in rows)
    return MeasuredSets(
        effects=effects,
        loss_clean=float(clean[0]) if language_model and ids.shape[-1] > 1 else None,
        forward_equivalents=recordings + 1 + layers_run / facts.num_layers,  # + the clean row
    )


def in_steps(part: Callable[[int, int], Tensor], length: int) -> Tensor:
    """``part(start, end)`` over consecutive ranges of at most :data:`POSITIONS_PER_BLOCK` of ``length`` positions,
    concatenated on the last dimension, with the call's checkpoint before each range.

    A long text's (B, T, V) logits in float64 are gigabytes and tens of seconds of work: reduced in one piece, a
    cancelled call would hold the model until the end (measured at 4,200 tokens: 31-38 s with no checkpoint).
    """
    checkpoint = call_checkpoint()
    parts = []
    for start in range(0, length, POSITIONS_PER_BLOCK):
        if checkpoint is not None:
            checkpoint()
        parts.append(part(start, min(start + POSITIONS_PER_BLOCK, length)))
    return torch.cat(parts, dim=-1)


def stepped_losses(logits: Tensor, ids: Tensor) -> Tensor:
    """(B, T, V) logits, (B or 1, T) ids, T > 1 -> (B, T−1) :func:`next_token_losses`, computed :func:`in_steps`."""
    labels = ids.to(logits.device).expand(logits.shape[0], -1)
    # positions start..end-1 predict tokens start+1..end
    return in_steps(lambda s, e: next_token_losses(logits[:, s : e + 1], labels[:, s : e + 1]), logits.shape[1] - 1)


def stepped_kl(clean: Tensor, other: Tensor) -> Tensor:
    """(..., T, V) logits of P and Q -> (..., T) :func:`kl_divergence` ``KL(P ‖ Q)`` per position, :func:`in_steps`."""
    return in_steps(lambda s, e: kl_divergence(clean[..., s:e, :], other[..., s:e, :]), clean.shape[-2])


def random_sets(
    pool: Sequence[tuple[int, int]], count: int, draws: int, *, seed: int
) -> tuple[list[HeadSet], str | None]:
    """The baseline's head sets and, when fewer than ``draws`` could be drawn, the sentence saying so."""
    sets = draw_head_sets(pool, count, draws, seed=seed)
    if not sets:
        return [], (
            f"no baseline: it needs {count} head{'s' if count != 1 else ''} outside those examined, and the model "
            f"has {len(set(pool))} to draw from"
        )
    if len(sets) < draws:
        return sets, f"baseline from {len(sets)} draws, every distinct set of {count} from {len(set(pool))} heads"
    return sets, None


def baseline_of(effects: Sequence[SetEffect]) -> Baseline:
    """The random draws' signed effects as a :class:`Baseline`."""
    return Baseline(tuple(e.effect for e in effects))
