"""The passes of attribution patching: one clean pass, one corrupted pass with a backward (Nanda 2023; AtP*).

* :func:`attribution_passes` — the clean run's head outputs (before W_O) and MLP outputs, then the corrupted run
  with the gradient of the metric with respect to every head output and MLP output; the first-order estimate of
  patching each one's clean value in (:mod:`agent_tools.analysis.attribution_patching`). With ``grad_drop`` the
  corrupted run carries L more batch rows, row ``layer + 1`` passing layer ``l``'s residual contribution without its
  gradient (GradDrop), so one backward gives every layer's dropped estimate.
* :func:`embedding_attribution` — the same for prompt segments: the answer's log-probability on the clean prompt,
  its gradient at the input embeddings, and (e_variant − e_clean) · gradient for each same-length variant (a
  segment replaced by neutral tokens).

Precision: the backward runs in the model's dtype; bfloat16 keeps float32's exponent range, but float16 would lose
small gradients to underflow, so there the metric is multiplied by :data:`FLOAT16_LOSS_SCALE` before the backward
and the gradients divided by it after; every product and sum of the estimate is in float64. The model's weights
never need gradients (only the embeddings' output is made to require one); a model whose embedding table is not
floating point (quantized) is refused. These are the only runner passes outside ``inference_mode``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from agent_tools.analysis.attribution_patching import grad_drop_scores, head_estimates, output_estimates
from agent_tools.capture import hooks_registered
from agent_tools.errors import InvalidInputError
from agent_tools.intervene import circuit_taps, mlp_outputs_replaced, residual_gradients_dropped
from agent_tools.loading import LoadedModel, loaded_dtype
from agent_tools.runner.forward import float_embeddings, on_device
from agent_tools.runner.saturation import saturation_corrected, saturation_state

FLOAT16_LOSS_SCALE = 4096.0  # the metric is scaled by this before a float16 backward (no underflow), then unscaled

# (clean (V,), logits (B, V)) float32 last-position logits -> (B,) the metric of each row (the clean run's logits
# are given so a metric may resolve its tokens from them, e.g. the clean prompt's top token)
Metric = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class AttributionPasses:
    """First-order estimates of patching each component's clean output into the corrupted run."""

    heads: Tensor  # (L, T, H) float64: per layer, position and head
    mlp: Tensor  # (L, T) float64; NaN rows where a layer's MLP output was not found
    grad_drop: Tensor | None  # (L, H) GradDrop score per head (None without grad_drop)
    clean_heads: dict[int, Tensor]  # layer -> (T, H, D) the clean run's head outputs (what exact patching copies)
    clean_mlp: dict[int, Tensor]  # layer -> (T, C) the clean run's MLP outputs
    clean_logits: Tensor  # (V,) float32 at the last position
    corrupted_logits: Tensor  # (V,)
    gradient_dtype: str  # the backward's dtype, and the loss scale when one was used
    rows: int  # batch rows of the corrupted forward and backward
    saturated: dict[int, list[int]] | None = None  # AtP*: layer -> heads whose softmax got the corrected backward


def gradient_embeddings(loaded: LoadedModel, field: str) -> nn.Module:
    """The input embedding module, refused (naming ``field``) when its table is not floating point."""
    msg = (
        f"attribution patching needs gradients through the input embeddings; model {loaded.name!r} has no "
        "floating-point embedding table (quantized or missing): use method 'exact', or load it unquantized"
    )
    return float_embeddings(loaded, msg, field)


def _loss_scale(loaded: LoadedModel) -> float:
    return FLOAT16_LOSS_SCALE if loaded_dtype(loaded.model) == torch.float16 else 1.0


def _dtype_note(loaded: LoadedModel) -> str:
    scale = _loss_scale(loaded)
    dtype = str(loaded_dtype(loaded.model)).removeprefix("torch.")
    return f"{dtype} (loss scale {scale:g}, sums in float64)" if scale != 1.0 else f"{dtype} (sums in float64)"


def _last_logits(loaded: LoadedModel, ids: Tensor) -> Tensor:
    """(B, T) ids -> (B, V) float32 logits at the last position (the model's own forward)."""
    return loaded.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()


def attribution_passes(
    loaded: LoadedModel,
    clean_ids: Tensor,
    corrupted_ids: Tensor,
    metric: Metric,
    *,
    grad_drop: bool,
    field: str,
    saturation_fix: bool = True,
) -> AttributionPasses:
    """(1, T) clean and corrupted ids and a metric of the last-position logits -> every head's, every position's
    and every MLP's first-order patching estimate (denoising: clean values into the corrupted run). With
    ``saturation_fix`` (AtP*) both passes run eager attention in float32 (:mod:`agent_tools.runner.saturation`):
    the clean pass records every layer's scores, and in the corrupted backward each head whose softmax is saturated
    over the change passes on the gradient of the pattern recomputed exactly."""
    facts = loaded.facts
    layers = list(range(facts.num_layers))
    heads, width = facts.num_heads, facts.head_dim
    embeddings = gradient_embeddings(loaded, field)
    clean, corrupted = on_device(loaded, clean_ids), on_device(loaded, corrupted_ids)

    def taps_of() -> AbstractContextManager[dict[str, dict[int, Tensor]]]:
        return circuit_taps(loaded.model, layers, num_heads=heads, head_dim=width, embeddings=embeddings, mlp=True)

    state = saturation_state(loaded.model) if saturation_fix else None

    def fixed(record: bool) -> AbstractContextManager[object]:
        return saturation_corrected(loaded.model, state, record=record) if state is not None else nullcontext()

    with loaded.lock:
        with torch.inference_mode(False), torch.no_grad(), taps_of() as taps, fixed(True):
            clean_logits = _last_logits(loaded, clean)[0]
        clean_heads = {
            layer: t[0].reshape(t.shape[1], heads, width).detach().clone() for layer, t in taps["heads"].items()
        }
        clean_mlp = {layer: t[0].detach().clone() for layer, t in taps["mlp"].items()}
        rows = 1 + (len(layers) if grad_drop else 0)
        batch = corrupted.expand(rows, -1)
        with ExitStack() as stack:
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            taps = stack.enter_context(taps_of())
            stack.enter_context(fixed(False))
            if grad_drop:
                stack.enter_context(residual_gradients_dropped(loaded.model, {layer: layer + 1 for layer in layers}))
            logits = _last_logits(loaded, batch)
            values = metric(clean_logits, logits)
            scale = _loss_scale(loaded)
            head_taps = [taps["heads"][layer] for layer in layers]
            mlp_layers = [layer for layer in layers if layer in taps["mlp"] and taps["mlp"][layer].requires_grad]
            wanted = head_taps + [taps["mlp"][layer] for layer in mlp_layers]
            if not all(t.requires_grad for t in wanted):
                msg = (
                    f"no gradient reaches the head outputs of {loaded.name!r} (its forward detaches them); use "
                    "method 'exact'"
                )
                raise InvalidInputError(msg, field=field)
            grads = torch.autograd.grad((values * scale).sum(), wanted, allow_unused=True)
    length = int(clean.shape[-1])
    per_head = torch.zeros(len(layers), rows, length, heads, dtype=torch.float64)
    for index, layer in enumerate(layers):
        grad = grads[index]
        if grad is None:
            continue
        grad = grad.reshape(rows, length, heads, width).detach().cpu().double() / scale
        corrupted_heads = head_taps[index][0].detach().reshape(length, heads, width).cpu()
        per_head[index] = head_estimates(clean_heads[layer].cpu()[None], corrupted_heads[None], grad)
    mlp = torch.full((len(layers), length), float("nan"), dtype=torch.float64)
    for offset, layer in enumerate(mlp_layers):
        grad = grads[len(layers) + offset]
        if grad is not None:
            corrupted_mlp = taps["mlp"][layer][0].detach().cpu()
            mlp[layer] = output_estimates(clean_mlp[layer].cpu(), corrupted_mlp, grad[0].detach().cpu() / scale)
    drop = grad_drop_scores(per_head[:, 1:].sum(2).transpose(0, 1)) if grad_drop else None  # (L, H)
    return AttributionPasses(
        heads=per_head[:, 0],
        mlp=mlp,
        grad_drop=drop,
        clean_heads=clean_heads,
        clean_mlp=clean_mlp,
        clean_logits=clean_logits.detach().cpu(),
        corrupted_logits=logits[0].detach().cpu(),
        gradient_dtype=_dtype_note(loaded),
        rows=rows,
        saturated={layer: heads for layer, heads in state.corrected.items() if heads} if state is not None else None,
    )


def mlp_patched_logits(loaded: LoadedModel, input_ids: Tensor, sources: dict[int, Tensor]) -> Tensor:
    """(1, T) ids and layer -> (T, C) MLP outputs to copy in -> (R, V) last-position logits, row r patching the
    r-th layer of ``sources`` alone (exact patching of whole MLP outputs; one batch, every row from layer 0)."""
    ids = on_device(loaded, input_ids)
    layers = list(sources)
    replaced = {layer: (row, sources[layer]) for row, layer in enumerate(layers)}
    with loaded.lock, torch.inference_mode(), mlp_outputs_replaced(loaded.model, replaced):
        return _last_logits(loaded, ids.expand(len(layers), -1)).clone()


@dataclass(frozen=True)
class SegmentEstimates:
    """First-order change of the answer's log-probability when each variant replaces the clean prompt."""

    estimates: Tensor  # (n,) float64, Δ Σ log p(answer); NaN for a variant of another length
    value: float  # Σ log p(answer) on the clean prompt


def embedding_attribution(
    loaded: LoadedModel, ids: Sequence[int], answer: Sequence[int], variants: Sequence[Sequence[int]]
) -> SegmentEstimates:
    """``ids``: prompt + answer[:-1] (teacher forcing); ``variants``: prompt variants (without the answer) of the
    prompt's length. One forward and one backward of Σ log p(answer) on the clean ids; per variant the estimate
    Σ_t (e_variant − e_clean)_t · ∂/∂e_t (noising: what replacing the segment would do to the clean answer)."""
    embeddings = gradient_embeddings(loaded, "checks")
    device_ids = on_device(loaded, torch.tensor([list(ids)]))
    count = len(answer)
    prompt = len(ids) - count + 1
    answer_ids = torch.tensor(list(answer), device=device_ids.device)
    kept: dict[str, Tensor] = {}

    def keep(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        leaf = output.detach().requires_grad_(True)
        kept["embedded"] = leaf
        return leaf

    scale = _loss_scale(loaded)
    with loaded.lock, torch.inference_mode(False), torch.enable_grad():
        with hooks_registered([embeddings.register_forward_hook(keep)]):
            logits = loaded.model(input_ids=device_ids, use_cache=False, logits_to_keep=count).logits[0].float()
        value = torch.log_softmax(logits, dim=-1).gather(-1, answer_ids[:, None]).sum()
        (grad,) = torch.autograd.grad(value * scale, [kept["embedded"]])
        grad = grad[0, :prompt].detach().double() / scale  # (T, C) over the prompt's positions
        embedded = kept["embedded"][0, :prompt].detach().double()
        estimates = []
        with torch.no_grad():
            for variant in variants:
                if len(variant) != prompt:
                    estimates.append(float("nan"))
                    continue
                other = embeddings(on_device(loaded, torch.tensor([list(variant)])))[0].double()
                estimates.append(float(((other - embedded) * grad).sum()))
    return SegmentEstimates(estimates=torch.tensor(estimates, dtype=torch.float64), value=float(value.detach()))
