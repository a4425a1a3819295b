"""Head-ablated forward passes: the clean run and the run with the named heads' outputs removed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_tools.intervene import AblationMethod, group_heads, heads_ablated, recorded_head_means
from agent_tools.loading import LoadedModel
from agent_tools.runner.forward import _mask_on_device, encoder_of, model_output, on_device


@dataclass(frozen=True)
class AblationEffect:
    """Clean vs ablated outputs of one input, as tensors for the service layer (never returned by a tool)."""

    clean: Tensor  # (B, T, V) logits or (B, T, C) hidden states
    ablated: Tensor
    language_model: bool


def ablated_forward(
    loaded: LoadedModel,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    heads: Sequence[tuple[int, int]],
    *,
    method: AblationMethod = "zero",
    clean: Tensor | None = None,
) -> AblationEffect:
    """Clean (unless given) and ablated forwards with the model's own attention implementation, under its lock.

    On an encoder–decoder the heads are the encoder stack's and the passes run the encoder alone: the effect is
    measured on the encoder's output (hidden states), as for an encoder-only model.
    """
    facts = loaded.facts
    input_ids, attention_mask = on_device(loaded, input_ids), _mask_on_device(loaded, attention_mask)
    grouped = group_heads(heads)
    model = loaded.model  # the hooks go on its (default-stack) attention modules
    run = encoder_of(loaded) if facts.is_encoder_decoder else model
    with loaded.lock, torch.inference_mode():
        means = None
        if clean is None or method == "mean":
            with recorded_head_means(
                model,
                list(grouped) if method == "mean" else [],
                num_heads=facts.num_heads,
                head_dim=facts.head_dim,
                attention_mask=attention_mask,
            ) as recorded:
                clean_out, is_lm = model_output(run(input_ids=input_ids, attention_mask=attention_mask))
            clean = clean if clean is not None else clean_out
            means = dict(recorded)
        with heads_ablated(
            model, grouped, num_heads=facts.num_heads, head_dim=facts.head_dim, method=method, means=means
        ):
            ablated, is_lm = model_output(run(input_ids=input_ids, attention_mask=attention_mask))
    return AblationEffect(clean=clean, ablated=ablated, language_model=is_lm)
