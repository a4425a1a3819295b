"""Interventions on a model's forward: remove chosen heads' contribution, record per-head outputs.

A head's contribution to the residual stream is its slice of the attention output before the output projection
(found for every family by :func:`agent_tools.layout.output_projection`): head ``h`` owns input features
``h·D .. (h+1)·D − 1``. We change that input with a forward pre-hook, registered only inside a context manager
and removed in ``finally``, so the model is exactly as it was afterwards. No attention weights are needed: the
model keeps its own implementation (sdpa). The projection's bias is shared by all heads and is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from agent_tools.analysis.ablation import masked_mean, replace_head_slices
from agent_tools.capture import hooks_registered
from agent_tools.families import find_attention_modules
from agent_tools.layout import output_projection

AblationMethod = Literal["mean", "resample", "zero"]
ABLATION_METHODS: tuple[AblationMethod, ...] = get_args(AblationMethod)


@contextmanager
def heads_ablated(
    model: nn.Module,
    heads: Mapping[int, Sequence[int]],
    *,
    num_heads: int,
    head_dim: int,
    method: AblationMethod = "zero",
    means: Mapping[int, Tensor] | None = None,
) -> Iterator[None]:
    """Inside the block, the named heads (layer -> heads) write zero, their mean output, or another run's output
    into the projection.

    Args:
        model: any family :func:`agent_tools.layout.output_projection` finds.
        heads: layer -> query heads to ablate.
        num_heads, head_dim: the layer's query heads and dims per head (the projection takes H·D features).
        method: ``zero`` replaces the heads' outputs by 0; ``mean`` by ``means[layer]`` (H, D), the same at every
            position; ``resample`` by ``means[layer]`` (T, H, D), another run's head outputs position by position
            (:func:`recorded_head_inputs` on a text of the same length).
        means: per-layer replacement head outputs for ``mean`` (see :func:`recorded_head_means`) or ``resample``.
    """
    if method not in ABLATION_METHODS:
        raise ValueError(f"method must be one of {ABLATION_METHODS}, got {method!r}")
    if method != "zero" and (means is None or any(layer not in means for layer in heads)):
        raise ValueError(f"{method} ablation needs the replacement head outputs of every ablated layer")
    projections = _projections(model, [layer for layer, chosen in heads.items() if chosen], num_heads * head_dim)

    def hook_for(layer: int):
        chosen = list(heads[layer])
        layer_means = means[layer] if method != "zero" and means is not None else None

        def hook(module: nn.Module, args: tuple) -> tuple:
            return (replace_head_slices(args[0], chosen, head_dim, layer_means), *args[1:])

        return hook

    with _pre_hooks(projections, hook_for):
        yield


@contextmanager
def recorded_head_means(
    model: nn.Module,
    layers: Sequence[int],
    *,
    num_heads: int,
    head_dim: int,
    attention_mask: Tensor | None = None,
) -> Iterator[dict[int, Tensor]]:
    """Inside the block, each forward records every head's mean output (H, D) per layer, over unmasked positions.

    The dict yielded is filled by the forward run inside the block (the last forward wins).
    """
    projections = _projections(model, layers, num_heads * head_dim)
    means: dict[int, Tensor] = {}

    def hook_for(layer: int):
        def hook(module: nn.Module, args: tuple) -> None:
            hidden = args[0]  # (B, T, H·D)
            mask = attention_mask if attention_mask is not None and attention_mask.shape == hidden.shape[:2] else None
            means[layer] = masked_mean(hidden, mask).reshape(num_heads, head_dim).detach().clone()  # (H, D)

        return hook

    with _pre_hooks(projections, hook_for):
        yield means


def group_heads(heads: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
    """[(layer, head), ...] -> {layer: [heads]} in layer order."""
    grouped: dict[int, list[int]] = {}
    for layer, head in heads:
        grouped.setdefault(layer, []).append(head)
    return dict(sorted(grouped.items()))


# --- evidence: per-row patches, gathered positions, head writes (activation patching, causal checks, DLA) -------
@contextmanager
def rows_joining(model: nn.Module, joining: Mapping[int, int], *, num_heads: int) -> Iterator[None]:
    """Inside the block, ``joining[l]`` copies of batch row 0 join the batch at the block of layer ``l``."""
    first = min(joining) if joining else 0
    blocks = _blocks_from(model, first)

    def join_for(layer: int):
        extra = joining.get(layer, 0)

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            hidden = block_input(args, kwargs)
            if extra:
                hidden = torch.cat([hidden, hidden[:1].expand(extra, *hidden.shape[1:])])
            alibi = kwargs.get("alibi")
            if isinstance(alibi, Tensor) and alibi.shape[0] == num_heads and hidden.shape[0] > 1:
                # BLOOM hands every block ALiBi as (B·H, 1, T), built once for the input's batch of one
                kwargs = {**kwargs, "alibi": alibi.repeat(hidden.shape[0], 1, 1)}
            return with_block_input(args, kwargs, hidden)

        return hook

    with hooks_registered(
        blocks[layer].register_forward_pre_hook(join_for(layer), with_kwargs=True) for layer in blocks
    ):
        yield


@contextmanager
def row_zero_leaving(model: nn.Module, layer: int) -> Iterator[None]:
    """Inside the block, batch row 0 leaves the batch at the block of ``layer`` (it runs layers ``< layer`` only).

    For a batch whose row 0 only feeds rows that joined before ``layer`` (its own output is known already): the
    output then holds rows 1.. in order. Register it before the joining hooks of the same forward (hooks run in the
    order registered)."""
    blocks = _blocks_from(model, layer)
    if layer not in blocks:
        raise ValueError(f"row 0 cannot leave at layer {layer}: the model has {layer} layers or fewer")

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = block_input(args, kwargs)
        if hidden.shape[0] < 2:
            raise ValueError(f"row 0 cannot leave a batch of {hidden.shape[0]} row at layer {layer}")
        return with_block_input(args, kwargs, hidden[1:])

    with hooks_registered([blocks[layer].register_forward_pre_hook(hook, with_kwargs=True)]):
        yield


def _blocks_from(model: nn.Module, first: int) -> dict[int, nn.Module]:
    """Layer -> its block (the element of the model's layer list holding its attention module), from ``first`` on."""
    names = {id(module): name for name, module in model.named_modules()}
    blocks = {}
    for layer, attention in enumerate(find_attention_modules(model)):
        if layer >= first:
            blocks[layer] = _block_of(model, names[id(attention)].split("."), layer)
    return blocks


def _block_of(model: nn.Module, path: list[str], layer: int) -> nn.Module:
    """The block on an attention module's dotted ``path``: the first ancestor whose parent is a ModuleList."""
    for cut in range(len(path) - 1, 0, -1):
        parent = model.get_submodule(".".join(path[: cut - 1])) if cut > 1 else model
        if isinstance(parent, nn.ModuleList):
            return model.get_submodule(".".join(path[:cut]))
    raise ValueError(f"layer {layer}'s attention module is not inside a list of blocks")


def _projections(model: nn.Module, layers: Iterable[int], width: int) -> dict[int, nn.Module]:
    """Layer -> its output projection (W_O), which takes ``width`` = H·D head features."""
    return {layer: output_projection(model, layer, in_features=width) for layer in layers}


def block_input(args: tuple, kwargs: dict) -> Tensor:
    """The hidden states a block (or an attention module) was called with: its first argument or ``hidden_states=``."""
    return args[0] if args and isinstance(args[0], Tensor) else kwargs["hidden_states"]


def with_block_input(args: tuple, kwargs: dict, hidden: Tensor) -> tuple[tuple, dict]:
    """A pre-hook's (args, kwargs) with the hidden states replaced by ``hidden``, where the call passed them."""
    if args and isinstance(args[0], Tensor):
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def first_output(output: Any) -> Any:
    """A module's output tensor: the output itself, or the first item of a tuple (blocks, MLPs of some families)."""
    return output[0] if isinstance(output, tuple) else output


def with_first_output(output: Any, value: Tensor) -> Any:
    """``output`` with its tensor (:func:`first_output`) replaced by ``value``, in the same form."""
    return (value, *output[1:]) if isinstance(output, tuple) else value


@contextmanager
def _heads_replaced(
    model: nn.Module, replaced: Mapping[int, Sequence[tuple[Tensor, Tensor | None]]], num_heads: int, head_dim: int
) -> Iterator[None]:
    """Each layer's output projection replaces, row by row, the heads each of its ``(mask, source)`` pairs marks:
    ``mask`` (R_l, T or 1, H) bool, True where row r's head h at position t (or at every one) is replaced by
    ``source``: (T, H, D) another run's head outputs, (H, D) the same at every position, or None (zeros)."""
    projections = _projections(model, replaced, num_heads * head_dim)

    def hook_for(layer: int):
        pairs = replaced[layer]

        def hook(module: nn.Module, args: tuple) -> tuple:
            hidden = args[0]  # (B, T, H·D), B = 1 before the first patched layer, R_l after it
            count, length = pairs[0][0].shape[0], hidden.shape[1]
            if hidden.shape[0] == 1 and count > 1:
                hidden = hidden.expand(count, *hidden.shape[1:])
            per_head = hidden.reshape(count, length, num_heads, head_dim)  # (R_l, T, H, D)
            for mask, source in pairs:
                chosen = mask.to(hidden.device)[..., None]  # (R_l, T or 1, H, 1)
                replacement = torch.zeros((), dtype=hidden.dtype, device=hidden.device)
                if source is not None:
                    replacement = source.to(device=hidden.device, dtype=hidden.dtype)
                    replacement = replacement.reshape(1, -1, num_heads, head_dim)  # (1, T or 1, H, D)
                per_head = torch.where(chosen, replacement, per_head)
            return (per_head.reshape(count, length, num_heads * head_dim), *args[1:])

        return hook

    with _pre_hooks(projections, hook_for):
        yield


@contextmanager
def recorded_head_inputs(model: nn.Module, layers: Sequence[int], *, num_heads: int, head_dim: int) -> Iterator[dict]:
    """Inside the block, each forward records every head's output before W_O: layer -> (T, H, D) of batch row 0.

    What activation patching copies from the clean run into the corrupted one.
    """
    projections = _projections(model, layers, num_heads * head_dim)
    recorded: dict[int, Tensor] = {}

    def hook_for(layer: int):
        def hook(module: nn.Module, args: tuple) -> None:
            hidden = args[0]  # (B, T, H·D)
            recorded[layer] = hidden[0].reshape(hidden.shape[1], num_heads, head_dim).detach().clone()  # (T, H, D)

        return hook

    with _pre_hooks(projections, hook_for):
        yield recorded


@contextmanager
def positions_gathered(head: nn.Module, index: Tensor) -> Iterator[None]:
    """Inside the block, the output head (the unembedding) sees only the positions ``index`` (B, A) of each row.

    Logits are needed only where an answer token is predicted; gathering there keeps a batch of long variants from
    materialising (B, T, V) logits. Anything the model applies after the head (soft-capping) still applies.
    """

    def hook(module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]  # (B, T, C)
        gather = index.to(hidden.device)[..., None].expand(-1, -1, hidden.shape[-1])  # (B, A, C)
        return (hidden.gather(1, gather), *args[1:])

    with hooks_registered([head.register_forward_pre_hook(hook)]):
        yield


@contextmanager
def contiguous_input(module: nn.Module | None) -> Iterator[None]:
    """Inside the block, ``module`` receives its first input as a contiguous tensor (``None``: nothing to do).

    With ``logits_to_keep`` a model hands its head a slice of the batch, (B, 1, C) with the strides of (B, T, C);
    torch's matmul then cannot fold the batch into one matrix product and broadcasts the unembedding into a
    batched one. Measured on a 2-core CPU for 64 rows and a (49,152 × 576) head: 0.63 s per call strided, 0.08 s
    contiguous. The copy is B·C numbers; the values are unchanged.
    """
    if module is None:
        yield
        return

    def hook(_module: nn.Module, args: tuple) -> tuple:
        return (args[0].contiguous(), *args[1:]) if args and isinstance(args[0], Tensor) else args

    with hooks_registered([module.register_forward_pre_hook(hook)]):
        yield


@contextmanager
def appended_rows(
    module: nn.Module, extra: Callable[[Tensor], Tensor | None], keep: dict[str, Tensor]
) -> Iterator[None]:
    """Inside the block, ``module`` also runs on the rows ``extra()`` returns, appended to its input's sequence.

    The module computes its own output on them (so its weights are never read: with a device map or disk offload
    they exist only inside its forward); the appended part of the output is kept in ``keep["output"]``, its input
    in ``keep["input"]``, and the caller's output is exactly what it was. ``extra(hidden)`` gets the module's
    (1, T, F) input and returns (K, F) rows, or None to leave that call alone. The module must act on each position
    separately (a norm, a projection, the unembedding); the first call of the block is the one kept.
    """

    def pre_hook(module: nn.Module, args: tuple) -> tuple | None:
        hidden = args[0]  # (1, T, F)
        if "length" in keep:
            return None
        rows = extra(hidden)
        if rows is None:
            return None
        keep["length"] = torch.tensor(hidden.shape[1])
        keep["input"] = rows.detach()
        appended = torch.cat([hidden, rows.to(device=hidden.device, dtype=hidden.dtype)[None]], dim=1)
        return (appended, *args[1:])

    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        if "length" not in keep or "output" in keep:
            return None
        length = int(keep["length"])
        keep["output"] = output[0, length:].detach().clone()  # (K, F')
        return output[:, :length]

    with hooks_registered([module.register_forward_pre_hook(pre_hook), module.register_forward_hook(hook)]):
        yield


@contextmanager
def _pre_hooks(projections: Mapping[int, nn.Module], hook_for: Callable[[int], Callable[..., Any]]) -> Iterator[None]:
    """Register ``hook_for(layer)`` as a forward pre-hook on each layer's projection for the block; every hook is
    removed in ``finally`` (also when registering a later one fails)."""
    with hooks_registered(
        projection.register_forward_pre_hook(hook_for(layer)) for layer, projection in projections.items()
    ):
        yield


@contextmanager
def heads_patched_joining(
    model: nn.Module,
    replaced: Mapping[int, Sequence[tuple[Tensor, Tensor | None]]],
    joining: Mapping[int, int],
    *,
    num_heads: int,
    head_dim: int,
) -> Iterator[None]:
    """Inside the block, one forward of a sequence becomes a batch of patched (or ablated) variants of it, one per row.

    Args:
        replaced: layer -> ``(mask, source)`` pairs for every layer where some row replaces a head: ``mask``
            (R_l, T or 1, H) bool, True where row r's head h at position t (or at every one) is replaced by
            ``source``: (T, H, D) another run's head outputs (activation patching, resample ablation), (H, D) the
            same at every position (mean ablation), or None (zeros); ``R_l`` counts row 0 and every row that joined
            at or before ``l``.
        joining: layer -> how many rows join the batch at that layer (as copies of row 0), each at the first layer
            it replaces; a layer may hold masks without rows joining there (a row replacing heads in several
            layers: a set of heads).

    Rows join the batch at the layer they first change, which is the least work: the forward starts as one row, the
    unpatched run. At the block of layer ``l`` the rows joining there are appended as copies of row 0 (the same
    residual stream), and its output projection replaces their heads, so no row runs a layer before the one it
    changes. The output keeps row 0 first.
    """
    alive = 1
    for layer in sorted(set(replaced) | set(joining)):
        alive += joining.get(layer, 0)
        rows = {int(mask.shape[0]) for mask, _ in replaced.get(layer, ())}
        if rows - {alive}:
            raise ValueError(f"layer {layer}'s mask must have {alive} rows, got {min(rows - {alive})}")
    with rows_joining(model, joining, num_heads=num_heads), _heads_replaced(model, replaced, num_heads, head_dim):
        yield


# --- attribution patching: taps that keep outputs in the autograd graph, and GradDrop ------------------------------
def mlp_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Layer -> its block's MLP (the child named ``mlp``; layers whose block has none are left out)."""
    found = {}
    for layer, block in _blocks_from(model, 0).items():
        mlp = getattr(block, "mlp", None)
        if isinstance(mlp, nn.Module):
            found[layer] = mlp
    return found


@contextmanager
def residual_gradients_dropped(model: nn.Module, rows: Mapping[int, int]) -> Iterator[None]:
    """Inside the block, batch row ``rows[layer]`` passes its block's residual contribution forward unchanged but
    lets no gradient through it (GradDrop): output = input + (output − input).detach() for that row only."""
    blocks = _blocks_from(model, 0)
    inputs: dict[int, Tensor] = {}

    def pre_for(layer: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            inputs[layer] = block_input(args, kwargs)

        return hook

    def post_for(layer: int):
        row = rows[layer]

        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            hidden = first_output(output)
            change = hidden - inputs.pop(layer)
            chosen = torch.zeros(hidden.shape[0], 1, 1, dtype=hidden.dtype, device=hidden.device)
            chosen[row] = 1
            return with_first_output(output, hidden - chosen * change + chosen * change.detach())

        return hook

    def registrations() -> Iterator[RemovableHandle]:
        for layer in rows:
            yield blocks[layer].register_forward_pre_hook(pre_for(layer), with_kwargs=True)
            yield blocks[layer].register_forward_hook(post_for(layer))

    with hooks_registered(registrations()):
        yield


@contextmanager
def mlp_outputs_replaced(model: nn.Module, replaced: Mapping[int, tuple[int, Tensor]]) -> Iterator[None]:
    """Inside the block, batch row ``row`` of layer ``layer``'s MLP output is replaced by ``source`` (T, C), for
    each ``layer -> (row, source)`` (exact patching of one layer's MLP output per row)."""
    modules = mlp_modules(model)
    missing = [layer for layer in replaced if layer not in modules]
    if missing:
        raise ValueError(f"layers {missing} have no MLP module named 'mlp'")

    def hook_for(layer: int):
        row, source = replaced[layer]

        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            patched = first_output(output).clone()
            patched[row] = source.to(device=patched.device, dtype=patched.dtype)
            return with_first_output(output, patched)

        return hook

    with hooks_registered(modules[layer].register_forward_hook(hook_for(layer)) for layer in replaced):
        yield


@contextmanager
def circuit_taps(
    model: nn.Module,
    layers: Sequence[int],
    *,
    num_heads: int,
    head_dim: int,
    embeddings: nn.Module,
    mlp: bool = False,
    stream: bool = False,
    readers: Mapping[int, Sequence[nn.Module]] | None = None,
    interpolate: Callable[[Tensor], Tensor] | None = None,
) -> Iterator[dict[str, dict[int, Any]]]:
    """Inside the block, a forward keeps (by reference, in the autograd graph) every layer's head outputs before
    W_O (``taps["heads"][layer]``, (B, T, H·D)); with ``mlp`` its MLP output (``taps["mlp"][layer]``, (B, T, C));
    with ``stream`` its block's input (the residual stream it reads, ``taps["residual"][layer]``), the input of its
    attention module (``taps["read"][layer]``: the normalised stream the q/k/v projections read) and the last
    block's output (``taps["final"][0]``); the outputs of ``readers[layer]`` (its q/k/v projection modules,
    ``taps["qkv"][layer]``, a list). The embeddings' output is made to require grad, so a backward reaches every tap
    without any weight needing one; ``interpolate`` (when given) replaces it first (EAP-IG's interpolation)."""
    projections = _projections(model, layers, num_heads * head_dim)
    blocks = _blocks_from(model, 0)
    attentions = find_attention_modules(model)
    mlps = {layer: module for layer, module in mlp_modules(model).items() if layer in projections} if mlp else {}
    taps: dict[str, dict[int, Any]] = {"residual": {}, "read": {}, "qkv": {}, "heads": {}, "mlp": {}, "final": {}}

    def input_tap(kind: str, layer: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            taps[kind][layer] = block_input(args, kwargs)

        return hook

    def output_tap(kind: str, layer: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            taps[kind][layer] = first_output(output)

        return hook

    def reader_post(layer: int, index: int):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            taps["qkv"].setdefault(layer, [None] * len(readers[layer]))[index] = output  # type: ignore[index]

        return hook

    def head_hook(layer: int):
        def hook(module: nn.Module, args: tuple) -> None:
            taps["heads"][layer] = args[0]

        return hook

    def embedding_hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        changed = interpolate(output) if interpolate is not None else output
        return changed if changed.requires_grad else changed.detach().requires_grad_(True)

    def registrations() -> Iterator[RemovableHandle]:
        yield embeddings.register_forward_hook(embedding_hook)
        for layer, module in mlps.items():
            yield module.register_forward_hook(output_tap("mlp", layer))
        if stream:
            yield blocks[max(blocks)].register_forward_hook(output_tap("final", 0))
        for layer in layers if stream else ():
            yield blocks[layer].register_forward_pre_hook(input_tap("residual", layer), with_kwargs=True)
            yield attentions[layer].register_forward_pre_hook(input_tap("read", layer), with_kwargs=True)
        for layer, modules in (readers or {}).items():
            for index, module in enumerate(modules):
                yield module.register_forward_hook(reader_post(layer, index))

    with hooks_registered(registrations()), _pre_hooks(projections, head_hook):
        yield taps
