"""Forward passes for evidence beside attention: segment ablations, input gradients, direct logit attribution.

* :func:`segment_ablations` — the answer's teacher-forced log-probabilities with each prompt segment removed and
  replaced by neutral tokens. The clean prompt runs once with its KV cache; a segment's two variants share the
  clean prefix before the segment, so they run as one batch of two rows from there on: n segments cost the tokens
  after each segment's start, not n whole forwards.
* :func:`input_gradients` — integrated gradients (Captum's ``LayerIntegratedGradients`` on the input embeddings)
  and gradient × input of the answer's log-probability, per input token, with the convergence delta.
* :func:`direct_logits` — what every head writes into one logit through W_O, the final norm with its scale frozen
  at the clean run's value, and the unembedding; every module runs its own forward on the extra rows
  (:func:`agent_tools.intervene.appended_rows`), so no weight is read and device maps and disk offload work.

Each function holds the model's lock for its passes; only the gradient pass runs outside inference mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from agent_tools.analysis.attribution import answer_logprobs, frozen_norm_map, norm_scale
from agent_tools.capture import AttentionConsumer, capture_attention
from agent_tools.errors import InvalidInputError, UnsupportedModelError
from agent_tools.families import output_head
from agent_tools.intervene import appended_rows, positions_gathered
from agent_tools.layout import output_projection
from agent_tools.loading import LoadedModel
from agent_tools.runner.forward import float_embeddings, locked, on_device
from agent_tools.runner.generation import _cache_argument, cache_layers, cache_of

FINAL_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm")  # Llama-likes, GPT-2, OPT/NeoX, Phi
GRADIENT_FLOATS_PER_TOKEN_LAYER = 16  # × model width: activations a backward pass keeps per token and layer


@dataclass(frozen=True)
class SegmentVariant:
    """A segment's two ablations of the prompt's ids: removed, and replaced by neutral tokens of the same length."""

    start: int  # first position where both variants differ from the clean prompt
    removed: list[int]
    neutral: list[int]


@dataclass(frozen=True)
class AblationLogprobs:
    """Teacher-forced log-probabilities of the answer's tokens: clean, and per segment removed / neutral."""

    clean: Tensor  # (A,)
    removed: Tensor  # (n, A)
    neutral: Tensor  # (n, A)
    clean_top: int  # the most likely first answer token, clean
    removed_top: list[int]  # ... with each segment removed
    neutral_top: list[int]


def _head(loaded: LoadedModel) -> nn.Module:
    head = output_head(loaded.model)
    if head is None:
        msg = f"model {loaded.name!r} has no next-token head: causal checks need a language model"
        raise InvalidInputError(msg, field="checks")
    return head


def _shares_prefix(loaded: LoadedModel) -> bool:
    """Whether a clean prefix's KV cache can stand in for recomputing it (not with sliding-window caches)."""
    return loaded.facts.sliding_window is None


@dataclass(frozen=True)
class TracedAnswer:
    """A captured prompt forward that kept its KV cache: the causal checks start from it instead of rerunning it."""

    logits: Tensor  # (V,) next-token logits at the last prompt position
    cache: list[tuple[Tensor, Tensor]] | None  # per layer (1, Hkv, T, D) keys and values; None: not reusable


def traced_answer(
    loaded: LoadedModel,
    input_ids: Tensor,
    consumers: Sequence[AttentionConsumer],
    *,
    query_chunk: int | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> TracedAnswer:
    """One captured forward of a prompt (like ``runner.answer_logits``) that also returns its KV cache."""
    ids = on_device(loaded, input_ids)
    capture = capture_attention(loaded.model, consumers, query_chunk=query_chunk, checkpoint=checkpoint)
    with locked(loaded, checkpoint), torch.inference_mode(), capture:
        output = loaded.model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = cache_layers(output) if _shares_prefix(loaded) else None
    return TracedAnswer(output.logits[0, -1].float().clone(), cache)


def _clean_run(
    loaded: LoadedModel, prompt: list[int], answer: list[int], share: bool, traced: TracedAnswer | None
) -> tuple[Tensor, Any]:
    """(1, A, V) logits predicting each answer token after the clean prompt, and its KV cache (None unshared).

    With the traced pass's cache only the answer's own tokens run (none for a one-token answer).
    """
    if traced is not None and traced.cache is not None and share:
        first = traced.logits[None, None]  # (1, 1, V)
        if len(answer) == 1:
            return first, traced.cache
        ids = torch.tensor([answer[:-1]], device=loaded.device)
        past = {_cache_argument(loaded.model): cache_of(traced.cache, 1, len(prompt))}
        rest = loaded.model(input_ids=ids, use_cache=True, **past).logits.float()  # (1, A − 1, V)
        return torch.cat([first.to(rest.device), rest], dim=1), traced.cache
    ids = torch.tensor([prompt + answer[:-1]], device=loaded.device)
    index = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(answer))[None]  # (1, A)
    with positions_gathered(_head(loaded), index):
        output = loaded.model(input_ids=ids, use_cache=share)
    return output.logits.float(), (cache_layers(output) if share else None)


def _variant_batch(
    loaded: LoadedModel, variant: SegmentVariant, answer: list[int], cache: list[tuple[Tensor, Tensor]] | None
) -> Tensor:
    """(2, A, V) logits of one segment's removed and neutral variants, from the clean prefix before the segment.

    On an accelerator the two rows run as one batch, the shorter removed row right-padded. On a CPU a batch costs
    in proportion to its tokens, padding included, so each row runs alone: the removed row skips the segment's
    length of padding (same logits).
    """
    prefix = min(variant.start, len(variant.removed) - 1) if cache is not None else 0
    fulls = (variant.removed, variant.neutral)
    if not batches_rows(loaded):
        return torch.cat([_variant_rows(loaded, [full], prefix, answer, cache) for full in fulls])
    return _variant_rows(loaded, list(fulls), prefix, answer, cache)


def batches_rows(loaded: LoadedModel) -> bool:
    """Whether a segment's two variants run as one padded batch (not on a CPU, where padding costs its tokens)."""
    return loaded.device.type != "cpu"


def _variant_rows(
    loaded: LoadedModel,
    fulls: list[list[int]],
    prefix: int,
    answer: list[int],
    cache: list[tuple[Tensor, Tensor]] | None,
) -> Tensor:
    """(R, A, V) logits of whole-prompt variants ``fulls`` that start with the clean prompt's first ``prefix``
    tokens: only the positions from ``prefix`` on run (right-padded), after the clean cache of the prefix."""
    rows = [full[prefix:] + answer[:-1] for full in fulls]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), prefix + width, dtype=torch.long)
    mask[:, :prefix] = 1
    index = torch.zeros(len(rows), len(answer), dtype=torch.long)
    for r, (row, full) in enumerate(zip(rows, fulls, strict=True)):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, prefix : prefix + len(row)] = 1
        index[r] = torch.arange(len(answer)) + len(full) - 1 - prefix
    extra: dict[str, Any] = {"use_cache": prefix > 0}
    if prefix > 0 and cache is not None:
        extra[_cache_argument(loaded.model)] = cache_of(cache, len(rows), prefix)
    with positions_gathered(_head(loaded), index):
        output = loaded.model(input_ids=on_device(loaded, ids), attention_mask=on_device(loaded, mask), **extra)
    return output.logits.float()


def segment_ablations(
    loaded: LoadedModel,
    prompt: list[int],
    answer: list[int],
    variants: Sequence[SegmentVariant],
    *,
    traced: TracedAnswer | None = None,
) -> AblationLogprobs:
    """The answer's log-probabilities clean and under each segment's two ablations (one batch of two per segment).

    Rows are right-padded (a causal model's real tokens never read the padding) and only the positions that
    predict an answer token reach the unembedding. ``traced``: the traced pass's logits and cache, reused for the
    clean prompt.
    """
    answer_ids = torch.tensor(answer)
    share = _shares_prefix(loaded) and len(variants) > 0
    removed: list[Tensor] = []
    neutral: list[Tensor] = []
    tops: list[tuple[int, int]] = []
    with loaded.lock, torch.inference_mode():
        clean_logits, cache = _clean_run(loaded, prompt, answer, share, traced)
        for variant in variants:
            logits = _variant_batch(loaded, variant, answer, cache)  # (2, A, V)
            logprobs = answer_logprobs(logits, answer_ids)  # (2, A)
            removed.append(logprobs[0])
            neutral.append(logprobs[1])
            tops.append((int(logits[0, 0].argmax()), int(logits[1, 0].argmax())))
    empty = torch.zeros(0, len(answer), dtype=torch.float64)
    return AblationLogprobs(
        clean=answer_logprobs(clean_logits, answer_ids)[0],
        removed=torch.stack(removed) if removed else empty,
        neutral=torch.stack(neutral) if neutral else empty,
        clean_top=int(clean_logits[0, 0].argmax()),
        removed_top=[a for a, _ in tops],
        neutral_top=[b for _, b in tops],
    )


# --- gradients -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputGradients:
    """Per input token: integrated gradients and gradient × input of the answer's log-probability."""

    integrated: Tensor  # (T',) summed over the embedding dimensions
    gradient_x_input: Tensor  # (T',)
    delta: float  # Σ integrated − (f(input) − f(baseline)): how far the Riemann sum is from completeness
    value: float  # f(input): the answer's log-probability
    baseline_value: float  # f(baseline)
    steps: int


def gradient_bytes(loaded: LoadedModel, length: int) -> int:
    """Estimated activations one row of a backward pass over ``length`` tokens keeps (per token and layer: a few
    model widths, and the attention row of every head)."""
    facts = loaded.facts
    per_token_layer = GRADIENT_FLOATS_PER_TOKEN_LAYER * facts.hidden_size + 2 * facts.num_heads * length
    return 4 * length * facts.num_layers * per_token_layer


def input_embeddings(loaded: LoadedModel) -> nn.Module:
    """The input embedding module, if gradients can start there (a float embedding table)."""
    msg = (
        f"gradient attribution needs float input embeddings; model {loaded.name!r} has none "
        "(quantized or missing): ask for checks without 'gradient'"
    )
    return float_embeddings(loaded, msg, "checks")


def _answer_function(loaded: LoadedModel, answer: list[int]) -> Callable[[Tensor], Tensor]:
    """ids (B, T') -> (B,) summed log-probability of the teacher-forced answer (the last A positions predict it)."""
    answer_ids = torch.tensor(answer, device=loaded.device)

    def forward(ids: Tensor) -> Tensor:
        logits = loaded.model(input_ids=ids, logits_to_keep=len(answer)).logits  # (B, A, V)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        return logprobs.gather(-1, answer_ids.view(1, -1, 1).expand(ids.shape[0], -1, 1))[..., 0].sum(-1)

    return forward


def input_gradients(
    loaded: LoadedModel, ids: list[int], baseline: list[int], answer: list[int], *, steps: int, batch_rows: int
) -> InputGradients:
    """Integrated gradients from ``baseline`` ids to ``ids`` (prompt + answer[:-1]) and gradient × input.

    Captum's ``LayerIntegratedGradients`` interpolates the outputs of the input embedding module (Gauss-Legendre,
    ``steps`` points, ``batch_rows`` rows per forward); gradients reach only the embeddings (the weights keep
    ``requires_grad=False``). A model through which no gradient reaches the embeddings is refused.
    """
    from captum.attr import LayerGradientXActivation, LayerIntegratedGradients

    embeddings = input_embeddings(loaded)
    function = _answer_function(loaded, answer)
    inputs = torch.tensor([ids], device=loaded.device)
    reference = torch.tensor([baseline], device=loaded.device)
    with loaded.lock, torch.inference_mode(False), torch.enable_grad():
        try:
            times = LayerGradientXActivation(function, embeddings).attribute(inputs)
            integrated, delta = LayerIntegratedGradients(function, embeddings).attribute(
                inputs,
                baselines=reference,
                n_steps=steps,
                internal_batch_size=batch_rows,
                return_convergence_delta=True,
            )
        except RuntimeError as exc:
            if "does not require grad" not in str(exc) and "grad_fn" not in str(exc):
                raise
            msg = (
                f"no gradient reaches the input embeddings of {loaded.name!r} (its forward detaches them); "
                "ask for checks without 'gradient'"
            )
            raise InvalidInputError(msg, field="checks") from exc
        with torch.no_grad():
            values = function(torch.cat([inputs, reference]))
    return InputGradients(
        integrated=integrated[0].sum(-1).detach().double().cpu(),
        gradient_x_input=times[0].sum(-1).detach().double().cpu(),
        delta=float(delta.sum()),
        value=float(values[0]),
        baseline_value=float(values[1]),
        steps=steps,
    )


# --- direct logit attribution -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DirectLogits:
    """Every head's write into one logit at the last position, through W_O, the frozen final norm and W_U."""

    heads: Tensor  # (L, H) float64
    logit: float  # the model's logit for the token there
    norm: str  # "layer_norm" or "rms_norm": the final norm whose scale was frozen
    scale: float  # σ of the final residual at that position, frozen


def final_norm(model: nn.Module) -> tuple[nn.Module, bool, float]:
    """The norm before the unembedding: the module, whether it centres (LayerNorm) and its epsilon."""
    base = getattr(model, "base_model", model)
    for owner in (base, getattr(base, "decoder", None)):
        for name in FINAL_NORM_NAMES:
            module = getattr(owner, name, None) if owner is not None else None
            if isinstance(module, nn.Module):
                centred = isinstance(module, nn.LayerNorm)
                eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
                if (centred or "RMSNorm" in type(module).__name__) and isinstance(eps, float):
                    return module, centred, eps
    msg = "direct logit attribution needs a LayerNorm or RMSNorm right before the unembedding; none was found"
    raise UnsupportedModelError(msg)


def _head_rows(num_heads: int, head_dim: int) -> Callable[[Tensor], Tensor]:
    """o_proj input (1, T, H·D) -> (H + 1, H·D): the last position with only head h kept (row h), and zeros."""

    def rows(hidden: Tensor) -> Tensor:
        last = hidden[0, -1]  # (H·D,)
        keep = torch.zeros(num_heads + 1, num_heads, head_dim, dtype=last.dtype, device=last.device)
        keep[torch.arange(num_heads), torch.arange(num_heads)] = 1
        return (keep * last.reshape(1, num_heads, head_dim)).reshape(num_heads + 1, -1)

    return rows


def direct_logits(loaded: LoadedModel, input_ids: Tensor, token: int) -> DirectLogits:
    """One forward of (1, T) ids; each head's direct contribution to ``token``'s logit at the last position.

    Head h of layer l writes ``c = W_O^h z_h`` (its o_proj output less the bias); the final norm with σ frozen maps
    it linearly (:func:`~agent_tools.analysis.attribution.frozen_norm_map`); the unembedding less its value at 0
    gives the logit it adds. Before any soft-capping of the final logits.
    """
    facts, model = loaded.facts, loaded.model
    norm, centred, eps = final_norm(model)
    head = _head(loaded)
    writes: list[dict[str, Tensor]] = [{} for _ in range(facts.num_layers)]
    normed: dict[str, Tensor] = {}
    unembedded: dict[str, Tensor] = {}
    state: dict[str, Tensor] = {}

    def norm_rows(hidden: Tensor) -> Tensor:
        heads = torch.stack([w["output"][:-1] - w["output"][-1] for w in writes])  # (L, H, C)
        state["x"] = hidden[0, -1].detach()
        x = state["x"]
        return torch.cat([torch.zeros_like(x)[None], x[None], 2 * x[None], heads.reshape(-1, x.shape[-1])])

    def head_rows(hidden: Tensor) -> Tensor:
        outputs, inputs = normed["output"], normed["input"]
        state["lm_input"] = hidden[0, -1].detach()
        scale = norm_scale(state["x"], centred=centred, eps=eps)
        frozen = frozen_norm_map(outputs, inputs, outputs[0], centred=centred, eps=eps, scale=scale)
        state["linear"] = frozen[1:3]
        return torch.cat([torch.zeros_like(frozen[:1]), frozen[3:]]).to(hidden.dtype)

    ids = on_device(loaded, input_ids)
    with loaded.lock, torch.inference_mode(), ExitStack() as stack:
        for layer in range(facts.num_layers):
            projection = output_projection(model, layer, in_features=facts.num_heads * facts.head_dim)
            stack.enter_context(appended_rows(projection, _head_rows(facts.num_heads, facts.head_dim), writes[layer]))
        stack.enter_context(appended_rows(norm, norm_rows, normed))
        stack.enter_context(appended_rows(head, head_rows, unembedded))
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
    _check_frozen_norm(normed, state)
    per_head = unembedded["output"][1:, token].double() - unembedded["output"][0, token].double()
    return DirectLogits(
        heads=per_head.reshape(facts.num_layers, facts.num_heads).cpu(),
        logit=float(logits[0, -1, token]),
        norm="layer_norm" if centred else "rms_norm",
        scale=float(norm_scale(state["x"], centred=centred, eps=eps)),
    )


def _check_frozen_norm(normed: dict[str, Tensor], state: dict[str, Tensor]) -> None:
    """The norm found must feed the unembedding, and act as g ⊙ P(v)/σ(v) + β (checked on x and 2x)."""
    fed = torch.allclose(normed["output"][1].float(), state["lm_input"].float(), rtol=1e-4, atol=1e-5)
    once, twice = state["linear"][0], state["linear"][1]
    linear = torch.allclose(twice, 2 * once, rtol=1e-3, atol=1e-4 * float(once.abs().max()))
    if not (fed and linear):
        msg = (
            "the module before the unembedding is not a plain LayerNorm/RMSNorm feeding it directly; "
            "direct logit attribution through a frozen norm scale would be wrong, so it is refused"
        )
        raise UnsupportedModelError(msg)
