"""find_circuit's passes: edge attribution with integrated gradients (EAP-IG, Hanna et al. 2024).

One clean and one corrupted pass (no gradient) keep what every sender writes into the residual stream: the
embeddings (the first block's input) and every head's output projected through its slice of W_O. Then ONE forward
and ONE backward over ``steps`` batch rows, row k running the corrupted prompt with its input embeddings moved a
fraction α_k of the way to the clean prompt's, give the gradient of the metric at every head's q, k and v
projection output and at the last block's output. A head's slice of that gradient times the slice's weight is
the gradient at the normalised stream the head reads through that path; pulled back through the block's
normalisation (a vector–Jacobian product on the kept graph, no more forwards) it is the gradient at the residual
stream as read by that head's queries, keys or values, separately. Backward passes: 1, batched over the steps,
independent of the number of heads. Keys and values are shared by groups of query heads on a grouped-query model:
their receivers are KV heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_tools.analysis.edge_attribution import edge_scores, interpolation_points
from agent_tools.errors import InvalidInputError
from agent_tools.intervene import circuit_taps
from agent_tools.layout import output_weight, qkv_reads, slice_weight
from agent_tools.loading import LoadedModel
from agent_tools.runner.attribution_patching import _dtype_note, _last_logits, _loss_scale
from agent_tools.runner.forward import float_embeddings, on_device

Metric = Callable[[Tensor, Tensor], Tensor]  # (clean (V,), logits (B, V)) -> (B,)
EMBEDDINGS = (-1, -1)  # the embeddings' sender key


@dataclass(frozen=True)
class Receiver:
    layer: int  # num_layers for the logits
    head: int  # query head (Q), KV head (K, V); -1 for the logits
    kind: str  # Q, K, V or direct (the logits)


@dataclass(frozen=True)
class EdgePasses:
    senders: list[tuple[int, int]]  # (layer, head); EMBEDDINGS first
    receivers: list[Receiver]
    scores: Tensor  # (S, R) float64 estimated Δ metric per edge (clean − corrupted); 0 where no edge
    valid: Tensor  # (S, R) bool: the sender's layer is before the receiver's
    clean_heads: dict[int, Tensor]  # layer -> (T, H, D)
    corrupted_heads: dict[int, Tensor]
    embedding_delta: Tensor  # (T, C) what the embeddings write, clean − corrupted (the first block's input)
    clean_logits: Tensor  # (V,)
    corrupted_logits: Tensor  # (V,)
    steps: int
    gradient_dtype: str


def _residual_gradients(read: Tensor, residual: Tensor, vectors: Tensor) -> Tensor:
    """(P, B, T, C) gradients at the normalised stream -> (P, B, T, C) at the residual stream (VJP per path)."""
    try:
        (grads,) = torch.autograd.grad(read, residual, grad_outputs=vectors, retain_graph=True, is_grads_batched=True)
        return grads
    except RuntimeError:  # an op without a batching rule: one VJP per path
        rows = [torch.autograd.grad(read, residual, grad_outputs=v, retain_graph=True)[0] for v in vectors]
        return torch.stack(rows)


def edge_attribution(
    loaded: LoadedModel, clean_ids: Tensor, corrupted_ids: Tensor, metric: Metric, *, steps: int, field: str
) -> EdgePasses:
    """(1, T) ids and a metric of the last-position logits -> every edge's EAP-IG score."""
    facts = loaded.facts
    model = loaded.model
    layers = list(range(facts.num_layers))
    heads, width = facts.num_heads, facts.head_dim
    msg = (
        f"edge attribution needs gradients through the input embeddings; model {loaded.name!r} has no "
        "floating-point embedding table (quantized or missing): load it unquantized, or use patch_heads with "
        "method 'exact' for per-head effects"
    )
    embeddings = float_embeddings(loaded, msg, "model")
    clean, corrupted = on_device(loaded, clean_ids), on_device(loaded, corrupted_ids)
    reads = {layer: qkv_reads(model, layer, facts=facts) for layer in layers}
    readers = {layer: reads[layer][0] for layer in layers}
    scale = _loss_scale(loaded)

    def run(ids: Tensor) -> tuple[Tensor, Tensor, dict[int, Tensor]]:
        with torch.inference_mode(False), torch.no_grad():
            with circuit_taps(model, layers, num_heads=heads, head_dim=width, embeddings=embeddings, stream=True) as t:
                logits = _last_logits(loaded, ids)[0]
            outputs = {layer: t["heads"][layer][0].reshape(-1, heads, width).detach().clone() for layer in layers}
            return logits, t["residual"][0][0].detach().clone(), outputs

    with loaded.lock:
        clean_logits, clean_residual, clean_heads = run(clean)
        corrupted_logits, corrupted_residual, corrupted_heads = run(corrupted)
        with torch.inference_mode(False), torch.no_grad():
            clean_embedded = embeddings(clean).detach()
        alphas = interpolation_points(steps).to(device=clean_embedded.device, dtype=clean_embedded.dtype)

        def interpolate(output: Tensor) -> Tensor:
            return output + alphas[:, None, None] * (clean_embedded - output)

        receivers: list[Receiver] = []
        gradients: list[Tensor] = []
        with torch.inference_mode(False), torch.enable_grad():
            taps_cm = circuit_taps(
                model,
                layers,
                num_heads=heads,
                head_dim=width,
                embeddings=embeddings,
                stream=True,
                readers=readers,
                interpolate=interpolate,
            )
            with taps_cm as taps:
                logits = _last_logits(loaded, corrupted.expand(steps, -1))
            values = metric(clean_logits, logits)
            outputs = [out for layer in layers for out in taps["qkv"][layer]]
            final = taps["final"][0]
            if not all(t.requires_grad for t in [*outputs, final]):
                msg = f"no gradient reaches the q/k/v projections of {loaded.name!r}; find_circuit needs one"
                raise InvalidInputError(msg, field=field)
            grads = torch.autograd.grad((values * scale).sum(), [*outputs, final], retain_graph=True)
            offset = 0
            for layer in layers:
                modules, where = reads[layer]
                module_grads = grads[offset : offset + len(modules)]
                offset += len(modules)
                paths = sorted(where, key=lambda key: ("QKV".index(key[0]), key[1]))
                vectors = []
                for kind, head in paths:
                    index, start = where[(kind, head)]
                    weight = slice_weight(modules[index], start, width).to(module_grads[index].dtype)
                    vectors.append(module_grads[index][..., start : start + width] @ weight)  # (B, T, C)
                pulled = _residual_gradients(taps["read"][layer], taps["residual"][layer], torch.stack(vectors))
                gradients += [g.detach().double().mean(0).cpu() / scale for g in pulled]
                receivers += [Receiver(layer, head, kind) for kind, head in paths]
            gradients.append(grads[-1].detach().double().mean(0).cpu() / scale)
            receivers.append(Receiver(len(layers), -1, "direct"))
    senders: list[tuple[int, int]] = [EMBEDDINGS]
    deltas = [(clean_residual - corrupted_residual).double().cpu()]
    for layer in layers:
        w_o = output_weight(model, layer).double().cpu()  # (C, H·D)
        change = (clean_heads[layer] - corrupted_heads[layer]).double().cpu()  # (T, H, D)
        for head in range(heads):
            deltas.append(change[:, head] @ w_o[:, head * width : (head + 1) * width].T)
            senders.append((layer, head))
    scores = edge_scores(torch.stack(deltas), torch.stack(gradients))
    sender_layers = torch.tensor([s[0] for s in senders])
    receiver_layers = torch.tensor([r.layer for r in receivers])
    valid = sender_layers[:, None] < receiver_layers[None, :]
    return EdgePasses(
        senders=senders,
        receivers=receivers,
        scores=torch.where(valid, scores, torch.zeros_like(scores)),
        valid=valid,
        clean_heads=clean_heads,
        corrupted_heads=corrupted_heads,
        embedding_delta=deltas[0],
        clean_logits=clean_logits.detach().cpu(),
        corrupted_logits=corrupted_logits.detach().cpu(),
        steps=steps,
        gradient_dtype=_dtype_note(loaded),
    )
