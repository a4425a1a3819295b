"""Exact edge patching (find_circuit's faithfulness): the clean prompt runs with only a set of edges clean.

A receiver (a head's queries, keys or values; the logits) reads the residual stream as a sum of what every sender
wrote (the embeddings; every head through its slice of W_O) plus the MLPs' outputs and biases. With an edge set
``C``, receiver ``v`` reads ``x_v = x_run − Σ_{u: (u, v) ∉ C} (a_u,run − a_u,corrupted)``: the stream of this
(patched) run with every sender whose edge to ``v`` is not in the set put back to what it wrote in the corrupted
run. Each head's q, k and v are computed from its own ``x_v`` through the block's normalisation (so a head reads
L0H0 clean through its keys and corrupted through its queries when only the K edge is in the set). MLPs are not
nodes of the graph: an MLP reads the run's stream with every sender that is not a node of the circuit corrupted
(so the empty set reproduces the corrupted run exactly and the full set the clean run). Rows of one batch carry
different edge sets.

The normalisation a block applies before its attention and before its MLP is found by one probing forward (the
child module whose output the attention or MLP reads); a block where none is found is refused with
:class:`EdgePatchingUnsupported`, and find_circuit then measures node-level faithfulness and says so.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from agent_tools.capture import hooks_registered
from agent_tools.families import find_attention_modules
from agent_tools.intervene import (
    _blocks_from,
    block_input,
    first_output,
    mlp_modules,
    with_block_input,
    with_first_output,
)
from agent_tools.layout import output_projection, output_weight, qkv_reads, slice_weight
from agent_tools.loading import LoadedModel
from agent_tools.runner.edge_attribution import EMBEDDINGS, EdgePasses
from agent_tools.runner.forward import on_device
from agent_tools.runner.readout import Readout, stacked

Edge = tuple[int, int]  # (sender index, receiver index) in an EdgePasses' lists


class EdgePatchingUnsupported(Exception):
    """A block whose attention or MLP does not read a normalisation module's output directly."""


@dataclass
class _Norms:
    attention: dict[int, nn.Module]  # layer -> the module whose output the attention reads
    mlp: dict[int, nn.Module]  # layer -> the module whose output the MLP reads


def reading_norms(loaded: LoadedModel, ids: Tensor) -> _Norms:
    """One probing forward of ``ids`` (1, T): per block, the child whose output its attention / MLP reads."""
    model = loaded.model
    blocks = _blocks_from(model, 0)
    attentions = find_attention_modules(model)
    mlps = mlp_modules(model)
    outputs: dict[int, list[tuple[nn.Module, Tensor]]] = {layer: [] for layer in blocks}
    changing: dict[int, list[str]] = {layer: [] for layer in blocks}  # children that change what they are given
    reads: dict[tuple[str, int], Tensor] = {}

    def child_post(layer: int, name: str, module: nn.Module):
        def hook(_m: nn.Module, args: tuple, output: Any) -> None:
            if isinstance(output, Tensor):
                outputs[layer].append((module, output))
                given = args[0] if args and isinstance(args[0], Tensor) else None
                if given is None or not (output is given or torch.equal(output, given)):
                    changing[layer].append(name)

        return hook

    def reader_pre(kind: str, layer: int):
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            reads[(kind, layer)] = block_input(args, kwargs)

        return hook

    def registrations() -> Iterator[RemovableHandle]:
        for layer, block in blocks.items():
            skip = {id(attentions[layer]), id(mlps.get(layer))}
            for name, child in block.named_children():
                if id(child) not in skip:
                    yield child.register_forward_hook(child_post(layer, name, child))
            yield attentions[layer].register_forward_pre_hook(reader_pre("attention", layer), with_kwargs=True)
            if layer in mlps:
                yield mlps[layer].register_forward_pre_hook(reader_pre("mlp", layer), with_kwargs=True)

    with hooks_registered(registrations()), torch.inference_mode():
        model(input_ids=on_device(loaded, ids), use_cache=False, logits_to_keep=1)

    def source(kind: str, layer: int) -> nn.Module:
        read = reads.get((kind, layer))
        if read is not None:
            for module, output in outputs[layer]:  # the very tensor first: two norms may give equal outputs
                if output is read:
                    return module
            for module, output in outputs[layer]:
                if output.shape == read.shape and torch.equal(output, read):
                    return module
        msg = f"layer {layer}'s {kind} does not read a normalisation module's output directly"
        raise EdgePatchingUnsupported(msg)

    norms = _Norms(
        attention={layer: source("attention", layer) for layer in blocks},
        mlp={layer: source("mlp", layer) for layer in mlps},
    )
    for layer, block in blocks.items():
        reading = {id(norms.attention[layer]), id(norms.mlp.get(layer))}
        named = dict(block.named_children())
        extra = sorted({name for name in changing[layer] if id(named[name]) not in reading})
        if extra:
            msg = (
                f"layer {layer}'s block transforms the residual stream outside its attention and MLP "
                f"({', '.join(extra)}), so a head's write is not a W_O slice added to the stream"
            )
            raise EdgePatchingUnsupported(msg)
    return norms


@dataclass
class _State:
    """What one batch's hooks share: each layer's head-output differences and what they wrote."""

    heads: dict[int, Tensor] = field(default_factory=dict)  # layer -> (B, T, H, D) run − corrupted
    written: dict[int, Tensor] = field(default_factory=dict)  # layer -> (B, T, C) Σ_heads difference · W_O
    nodes_written: dict[int, Tensor] = field(default_factory=dict)  # the same over the circuit's heads only
    mlp_read: dict[int, tuple[Tensor, bool]] = field(default_factory=dict)  # layer -> (norm input, heads in it)
    corrections: dict[tuple[int, str, int], Tensor] = field(default_factory=dict)  # (layer, kind, head) -> Δread
    calling: bool = False  # our own call of a norm module: its hooks do nothing


@contextmanager
def edges_patched(
    loaded: LoadedModel,
    passes: EdgePasses,
    norms: _Norms,
    sets: Sequence[Sequence[Edge]],
    nodes: Sequence[set[int]],
) -> Iterator[None]:
    """Inside the block, a forward of ``len(sets)`` rows of the clean prompt runs row ``i`` with only ``sets[i]``
    clean (``nodes[i]``: the sender indices that are the circuit's nodes, for the MLPs' reads)."""
    model, facts = loaded.model, loaded.facts
    heads, width = facts.num_heads, facts.head_dim
    layers = list(range(facts.num_layers))
    blocks = _blocks_from(model, 0)
    attentions = find_attention_modules(model)
    mlps = mlp_modules(model)
    rows = len(sets)
    incoming: dict[int, list[tuple[int, int]]] = {}  # receiver -> (row, sender)
    for row, edges in enumerate(sets):
        for sender, receiver in edges:
            incoming.setdefault(receiver, []).append((row, sender))
    node_mask = torch.zeros(rows, facts.num_layers, heads)
    embeddings_node = torch.zeros(rows)
    for row, senders in enumerate(nodes):
        for s in senders:
            if passes.senders[s] == EMBEDDINGS:
                embeddings_node[row] = 1.0
            else:
                node_mask[row, passes.senders[s][0], passes.senders[s][1]] = 1.0
    w_o = {layer: output_weight(model, layer).float() for layer in layers}  # (C, H·D)
    state = _State()

    def on(tensor: Tensor, like: Tensor) -> Tensor:
        return tensor.to(device=like.device, dtype=torch.float32)

    def embedding_write(like: Tensor) -> Tensor:
        return on(passes.embedding_delta, like)  # (T, C)

    def before(layer: int, like: Tensor, *, nodes_only: bool, through: bool = False) -> Tensor:
        """(B, T, C): Σ of the write differences of every sender before ``layer`` (the circuit's nodes only)."""
        weight = on(embeddings_node, like)[:, None, None] if nodes_only else 1.0
        total = embedding_write(like)[None] * weight
        table = state.nodes_written if nodes_only else state.written
        for earlier in range(layer + 1 if through else layer):
            total = total + on(table[earlier], like)
        return total

    def sender_write(row: int, sender: int, like: Tensor) -> Tensor:
        if passes.senders[sender] == EMBEDDINGS:
            return embedding_write(like)
        layer, head = passes.senders[sender]
        block = slice(head * width, (head + 1) * width)
        return on(state.heads[layer][row, :, head], like) @ on(w_o[layer][:, block], like).T  # (T, C)

    def clean_edges(receiver: int, like: Tensor) -> Tensor:
        added = torch.zeros(like.shape, device=like.device, dtype=torch.float32)
        for row, sender in incoming.get(receiver, []):
            added[row] += sender_write(row, sender, like)
        return added

    def norm(module: nn.Module, x: Tensor) -> Tensor:
        state.calling = True
        try:
            return module(x)
        finally:
            state.calling = False

    receivers_at: dict[int, list[int]] = {}
    for r, reader in enumerate(passes.receivers):
        if r in incoming and reader.kind != "direct":
            receivers_at.setdefault(reader.layer, []).append(r)

    def block_pre(layer: int):
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            x = block_input(args, kwargs)
            base = x.float() - before(layer, x, nodes_only=False)
            normed = norm(norms.attention[layer], base.to(x.dtype))
            state.corrections[(layer, "base", 0)] = normed
            for r in receivers_at.get(layer, []):
                receiver = passes.receivers[r]
                read = norm(norms.attention[layer], (base + clean_edges(r, x)).to(x.dtype))
                state.corrections[(layer, receiver.kind, receiver.head)] = read.float() - normed.float()

        return hook

    def attention_pre(layer: int):
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return with_block_input(args, kwargs, state.corrections[(layer, "base", 0)])

        return hook

    def projection_post(layer: int, module_index: int, paths: list[tuple[str, int, int, Tensor]]):
        def hook(_m: nn.Module, _args: tuple, output: Tensor) -> Tensor:
            changed = output.clone()
            for kind, head, start, weight in paths:
                correction = state.corrections.get((layer, kind, head))
                if correction is not None:
                    delta = correction @ on(weight, correction).T  # (B, T, D)
                    changed[..., start : start + width] += delta.to(changed.dtype)
            return changed

        return hook

    def heads_pre(layer: int):
        def hook(_m: nn.Module, args: tuple) -> None:
            run = args[0].float()  # (B, T, H·D)
            difference = run - on(passes.corrupted_heads[layer], run).reshape(1, -1, heads * width)
            weight = on(w_o[layer], run)
            state.heads[layer] = difference.reshape(rows, -1, heads, width)
            state.written[layer] = difference @ weight.T
            mask = on(node_mask[:, layer], run).repeat_interleave(width, dim=1)[:, None, :]  # (B, 1, H·D)
            state.nodes_written[layer] = (difference * mask) @ weight.T

        return hook

    def mlp_norm_pre(layer: int):
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            if not state.calling:
                state.mlp_read[layer] = (block_input(args, kwargs), layer in state.heads)

        return hook

    def mlp_pre(layer: int):
        def hook(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            x, through = state.mlp_read[layer]
            everything = before(layer, x, nodes_only=False, through=through)
            circuit = before(layer, x, nodes_only=True, through=through)
            read = norm(norms.mlp[layer], (x.float() - everything + circuit).to(x.dtype))
            return with_block_input(args, kwargs, read)

        return hook

    def last_post(_m: nn.Module, _args: tuple, output: Any) -> Any:
        hidden = first_output(output)
        logits_receiver = len(passes.receivers) - 1
        changed = hidden.float() - before(len(layers), hidden, nodes_only=False) + clean_edges(logits_receiver, hidden)
        return with_first_output(output, changed.to(hidden.dtype))

    def registrations() -> Iterator[RemovableHandle]:
        for layer in layers:
            yield blocks[layer].register_forward_pre_hook(block_pre(layer), with_kwargs=True)
            yield attentions[layer].register_forward_pre_hook(attention_pre(layer), with_kwargs=True)
            modules, where = qkv_reads(model, layer, facts=facts)
            for module_index, module in enumerate(modules):
                paths = [
                    (kind, head, start, slice_weight(module, start, width))
                    for (kind, head), (i, start) in where.items()
                    if i == module_index
                ]
                yield module.register_forward_hook(projection_post(layer, module_index, paths))
            projection = output_projection(model, layer, in_features=heads * width)
            yield projection.register_forward_pre_hook(heads_pre(layer))
            if layer in mlps:
                yield norms.mlp[layer].register_forward_pre_hook(mlp_norm_pre(layer), with_kwargs=True)
                yield mlps[layer].register_forward_pre_hook(mlp_pre(layer), with_kwargs=True)
        yield blocks[max(blocks)].register_forward_hook(last_post)

    with hooks_registered(registrations()):
        yield


def edge_patched_logits(
    loaded: LoadedModel,
    clean_ids: Tensor,
    passes: EdgePasses,
    sets: Sequence[Sequence[Edge]],
    nodes: Sequence[set[int]],
    *,
    readout: Readout,
    max_rows: int,
) -> tuple[Tensor, ...]:
    """(1, T) clean ids and R edge sets -> what ``readout`` keeps of each row's (1, V) last-position logits
    (:mod:`agent_tools.runner.readout`), each row with only its edges clean (batches of at most ``max_rows`` rows).
    Raises :class:`EdgePatchingUnsupported` before any patched run when a block's normalisations cannot be
    found."""
    ids = on_device(loaded, clean_ids)
    results: list[tuple[Tensor, ...]] = []
    with loaded.lock:
        norms = reading_norms(loaded, ids)
        with torch.inference_mode():
            for start in range(0, len(sets), max_rows):
                chunk, chunk_nodes = sets[start : start + max_rows], nodes[start : start + max_rows]
                with edges_patched(loaded, passes, norms, chunk, chunk_nodes):
                    out = loaded.model(input_ids=ids.expand(len(chunk), -1), use_cache=False, logits_to_keep=1)
                results.append(readout(out.logits))  # only what the metric reads outlives the batch
    return stacked(results)
