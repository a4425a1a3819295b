"""Which attention path a report explains, and how far the model's own default path is from it on this text.

Capture computes the families' eager attention (:mod:`agent_tools.capture`); a model loaded by transformers runs
its default implementation (sdpa for most families). The two agree to ~1e-6 in float32 but not in half precision,
where sdpa rounds differently (random-weight bf16 models gave different top-1 tokens on 43 % of positions). So
every report states the path it explains and, when the model's default differs, the measured gap between the
two passes' outputs on the text the call ran: KL(eager ‖ default) of the next-token distributions and the share
of positions whose top-1 token agrees (a model without a language-model head: the largest difference of the
final hidden states only).

Two forwards per (model, text), cached by the inspector: the model's default, and every layer in the capture's
eager math with no consumer. The comparison runs on the CPU in float64, a block of positions at a time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from agent_tools.analysis.metrics import kl_divergence
from agent_tools.capture import capture_attention
from agent_tools.families import output_head
from agent_tools.loading import LoadedModel
from agent_tools.runner.forward import _mask_on_device, locked, model_output, on_device, stack_runner
from agent_tools.runner.readout import POSITIONS_PER_BLOCK

EXPLAINED_PATH = "eager"  # what capture computes: the families' eager attention
# A language model's gap is compared over at most the last GAP_POSITIONS positions (``PathGap.tokens`` says how
# many): both passes still run the whole text, but each keeps (GAP_POSITIONS, vocabulary) logits, not (T, vocabulary)
# — 1.6 GB a pass at 8,192 tokens on the default model.
GAP_POSITIONS = 512


@dataclass(frozen=True)
class PathGap:
    """The model's default pass against the eager pass capture explains, on one text (full precision)."""

    default: str  # the model's own attention implementation ("sdpa", "eager", "flash_attention_2", ...)
    tokens: int  # positions compared
    max_output_difference: float  # max |eager − default| of the logits (hidden states without an LM head)
    mean_kl: float | None  # mean over positions of KL(eager ‖ default), nats (None without an LM head)
    max_kl: float | None
    top1_agreement: float | None  # share of positions whose argmax token is the same


def default_implementation(loaded: LoadedModel) -> str:
    """The attention implementation the model runs outside a capture (what its users deploy).

    Read under the model's lock: a capture running in another thread switches the config while it holds it."""
    with loaded.lock:
        return str(getattr(loaded.model.config, "_attn_implementation", None) or "eager")


def path_gap(
    loaded: LoadedModel,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    *,
    decoder_input_ids: Tensor | None = None,
    query_chunk: int | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> PathGap:
    """Run the text through the model's default path and through the eager path; compare their outputs."""
    ids, mask, model, extra = _own_pass(loaded, input_ids, attention_mask, decoder_input_ids)
    with locked(loaded, checkpoint), torch.inference_mode():
        default = default_implementation(loaded)
        own, _ = model_output(model(input_ids=ids, attention_mask=mask, **extra))
        with capture_attention(loaded.model, [], query_chunk=query_chunk, checkpoint=checkpoint):
            eager, _ = model_output(model(input_ids=ids, attention_mask=mask, **extra))
    keep = None
    if mask is not None and decoder_input_ids is None and mask.shape == own.shape[:2]:
        keep = mask.bool().cpu().reshape(-1)  # padded positions have no meaningful output
    return compare_outputs(eager, own, default=default, keep=keep, logits=_has_logits(model, own))


def own_output_finite(
    loaded: LoadedModel, input_ids: Tensor, attention_mask: Tensor | None, decoder_input_ids: Tensor | None = None
) -> bool:
    """Whether the model's own forward on these inputs gives finite outputs (a language model's last positions'
    logits: a non-finite value anywhere earlier reaches them through attention)."""
    ids, mask, model, extra = _own_pass(loaded, input_ids, attention_mask, decoder_input_ids)
    with locked(loaded, None), torch.inference_mode():
        output, _ = model_output(model(input_ids=ids, attention_mask=mask, **extra))
    return bool(torch.isfinite(output).all())


def _own_pass(
    loaded: LoadedModel, input_ids: Tensor, attention_mask: Tensor | None, decoder_input_ids: Tensor | None
) -> tuple[Tensor, Tensor | None, torch.nn.Module, dict[str, Any]]:
    """The ids and mask on the model's device, what runs them (an encoder–decoder without decoder ids: its
    encoder) and its arguments; a long unpadded text keeps only its last positions' logits, not (T, vocabulary)."""
    ids, mask = on_device(loaded, input_ids), _mask_on_device(loaded, attention_mask)
    model, extra = stack_runner(loaded, decoder_input_ids if loaded.facts.is_encoder_decoder else None)
    if _keeps_logits(model) and (mask is None or bool(mask.all())) and ids.shape[-1] > GAP_POSITIONS:
        extra["logits_to_keep"] = GAP_POSITIONS
    return ids, mask, model, extra


def compare_outputs(
    eager: Tensor, own: Tensor, *, default: str, keep: Tensor | None = None, logits: bool = True
) -> PathGap:
    """(B, T, V) outputs of the two passes -> the gap; ``keep`` (B·T,) bool selects real positions."""
    flat_eager = eager.reshape(-1, eager.shape[-1])
    flat_own = own.reshape(-1, own.shape[-1])
    if keep is not None:
        flat_eager, flat_own = flat_eager[keep.to(flat_eager.device)], flat_own[keep.to(flat_own.device)]
    positions = flat_eager.shape[0]
    largest = torch.zeros((), dtype=torch.float64)
    kl_sum = torch.zeros((), dtype=torch.float64)
    kl_max = torch.zeros((), dtype=torch.float64)
    agree = torch.zeros((), dtype=torch.int64)
    for start in range(0, positions, POSITIONS_PER_BLOCK):
        a = flat_eager[start : start + POSITIONS_PER_BLOCK].cpu()  # float64 only on the CPU
        b = flat_own[start : start + POSITIONS_PER_BLOCK].cpu()
        largest = torch.maximum(largest, (a.double() - b.double()).abs().amax())
        if logits:
            kl = kl_divergence(a, b)  # (positions,) KL(eager ‖ default)
            kl_sum += kl.sum()
            kl_max = torch.maximum(kl_max, kl.amax())
            agree += (a.argmax(-1) == b.argmax(-1)).sum()
    numbers = torch.stack([largest, kl_sum, kl_max, agree.double()]).tolist()  # one copy to Python
    if not logits or positions == 0:
        return PathGap(default, positions, numbers[0], None, None, None)
    return PathGap(default, positions, numbers[0], numbers[1] / positions, numbers[2], numbers[3] / positions)


def _keeps_logits(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (transformers' causal LMs)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _has_logits(model: torch.nn.Module, output: Tensor) -> bool:
    return getattr(output_head(model), "out_features", None) == output.shape[-1]
