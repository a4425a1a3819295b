"""find_circuit's passes: EAP-IG edge scores (one batched backward), then faithfulness of the ranked edge sets and of
random edge sets of the same sizes, measured by exact edge patching in one batch of patched runs. Three orders are
tried (by |score|, by score, by paths grown from the logits: :func:`_path_order`); the circuit is the shortest
prefix of one reaching the target.

Faithfulness is edge-level (:mod:`agent_tools.runner.edge_patching`): the clean prompt runs with each head's
queries, keys and values and the logits reading the clean-run write of a sender only when that edge is in the set,
the corrupted-run write otherwise; MLPs read the circuit's nodes clean and every other sender corrupted. It is
(LD − LD_corrupted) / (LD_clean − LD_corrupted). Where a block's normalisations cannot be found, or the empty set
does not reproduce the corrupted run (a block that does not add head outputs to the stream as W_O slices), it is
node-level instead (every head that is not an endpoint of the set corrupted; embeddings and MLPs clean), and the
report's ``faithfulness_method`` says which and why.
"""

from __future__ import annotations

import hashlib
import heapq
import random

import torch

from agent_tools.analysis.attribution_patching import minimum_gap
from agent_tools.analysis.edge_attribution import curve_sizes
from agent_tools.analysis.metrics import Baseline
from agent_tools.clean_corrupted import LogitDifference, encode_pair, first_difference, restored
from agent_tools.errors import InvalidInputError
from agent_tools.files import write_atomic
from agent_tools.inspector import Encoded, Inspector
from agent_tools.loading import LoadedModel
from agent_tools.runner.edge_attribution import EMBEDDINGS, EdgePasses, Receiver
from agent_tools.runner.edge_patching import EdgePatchingUnsupported
from agent_tools.runner.patching import HeadPatch
from agent_tools.runner.readout import last_position
from agent_tools.schemas import NextCall
from agent_tools.tools.find_circuit.models import (
    CircuitEdge,
    CircuitNode,
    CircuitReport,
    CurvePoint,
    FindCircuitInput,
    NodeKind,
    Ranking,
)
from agent_tools.tools.find_circuit.narrative import findings, sentence, summary
from agent_tools.tools.find_circuit.picture import circuit_html, circuit_png
from agent_tools.wording import head_name

DRAWS = 5  # random edge sets per size
SEED = 0
RANKED = 200  # the ranked edge sets tried go up to this many edges, in three orders: by |score|, by score
# (toward the clean answer first) and by paths; the one reaching the target with fewer edges is the circuit
THRESHOLD = 0.25  # edges with |score| ≥ this share of the gap are listed even beyond the circuit's size
EDGE_LEVEL = (
    "edge-level (exact edge patching): each head's Q, K and V inputs and the logits read a sender's clean-run "
    "write only through an edge in the set, its corrupted-run write otherwise; MLPs read the circuit's nodes clean "
    "and every other sender corrupted"
)
NODE_LEVEL = (
    "node-level: the clean prompt with every head outside the edge set's endpoints replaced by its corrupted-run "
    "output (embeddings and MLPs clean); exact edge patching was not possible: {why}"
)
EMPTY_TOLERANCE = 0.02  # the empty edge set must reproduce the corrupted run's logit difference to this share

Edge = tuple[int, int]  # (sender index, receiver index)


def _receiver_name(loaded: LoadedModel, receiver: Receiver) -> str:
    if receiver.kind == "direct":
        return "logits"
    if receiver.kind == "Q" or loaded.facts.kv_groups == 1:
        return head_name(receiver.layer, receiver.head)
    return f"L{receiver.layer}KV{receiver.head}"


def _sender_name(sender: tuple[int, int]) -> str:
    return "embeddings" if sender == EMBEDDINGS else head_name(*sender)


def _receiver_heads(loaded: LoadedModel, receiver: Receiver) -> list[tuple[int, int]]:
    if receiver.kind == "direct":
        return []
    if receiver.kind == "Q":
        return [(receiver.layer, receiver.head)]
    return [(receiver.layer, head) for head in loaded.facts.heads_sharing_kv(receiver.head)]


def _nodes(loaded: LoadedModel, passes: EdgePasses, edges: list[Edge]) -> set[tuple[int, int]]:
    heads: set[tuple[int, int]] = set()
    for s, r in edges:
        if passes.senders[s] != EMBEDDINGS:
            heads.add(passes.senders[s])
        heads.update(_receiver_heads(loaded, passes.receivers[r]))
    return heads


def _complement_patch(loaded: LoadedModel, kept: set[tuple[int, int]]) -> HeadPatch | None:
    """One row corrupting every head not in ``kept`` (None: every head is kept)."""
    facts = loaded.facts
    every = [(layer, head) for layer in range(facts.num_layers) for head in range(facts.num_heads)]
    rest = [x for x in every if x not in kept]
    return HeadPatch.together(rest) if rest else None


def _faithfulness(
    inspector: Inspector,
    loaded: LoadedModel,
    passes: EdgePasses,
    clean: Encoded,
    first: int,
    sets: list[list[Edge]],
    metric: tuple[int, int, float, float],
) -> list[float]:
    """Node-level faithfulness of each edge set (one batch of patched runs of the clean prompt)."""
    answer, wrong, ld_clean, ld_corrupted = metric
    patches = [_complement_patch(loaded, _nodes(loaded, passes, edges)) for edges in sets]
    rows = [p for p in patches if p is not None]
    values: list[float] = []
    if rows:
        chosen = inspector.patched_outputs(
            loaded, clean, rows, readout=last_position((answer, wrong)), sources=passes.corrupted_heads, prefix=first
        )[0]  # (R, 2): each row's answer and wrong logits at the last position
        values = restored(chosen, ld_clean, ld_corrupted)[0].tolist()
    found = iter(values)
    return [1.0 if p is None else next(found) for p in patches]


def _node_senders(loaded: LoadedModel, passes: EdgePasses, edges: list[Edge]) -> set[int]:
    """Sender indices of an edge set's nodes: its senders and the heads its receivers stand for."""
    heads = {1 + layer * loaded.facts.num_heads + head for layer, head in _nodes(loaded, passes, edges)}
    return heads | {s for s, _ in edges}


def _edge_faithfulness(
    inspector: Inspector,
    loaded: LoadedModel,
    passes: EdgePasses,
    clean: Encoded,
    sets: list[list[Edge]],
    metric: tuple[int, int, float, float],
) -> tuple[list[float] | None, str]:
    """Edge-level faithfulness of each edge set (the last set must be empty: it checks the decomposition), or
    None and why not."""
    answer, wrong, ld_clean, ld_corrupted = metric
    nodes = [_node_senders(loaded, passes, edges) for edges in sets]
    try:
        chosen = inspector.edge_patched_logits(
            loaded, clean, passes, sets, nodes, readout=last_position((answer, wrong))
        )
    except EdgePatchingUnsupported as error:
        return None, str(error)
    values = restored(chosen[0], ld_clean, ld_corrupted)[0].tolist()
    if abs(values[-1]) > EMPTY_TOLERANCE:
        why = (
            f"the empty edge set gave {values[-1]:.3f} of the gap instead of 0 (this family's blocks do not add "
            "head outputs to the stream as W_O slices)"
        )
        return None, why
    return values, EDGE_LEVEL


def _path_order(
    loaded: LoadedModel, passes: EdgePasses, shares: torch.Tensor, edges: list[Edge], count: int
) -> list[Edge]:
    """``count`` edges grown from the logits backward: each step adds the edge with the largest score toward the
    clean answer whose receiver is already joined to the logits by the circuit; after these, the other ``edges``
    by |score|.

    Exact edge patching restores a head's output only when what it reads is clean, so an edge helps only on a path
    to the logits whose start reads the clean prompt. MLPs are not nodes: they read every node of the circuit
    clean, so once the embeddings are a node every head of the circuit reads the clean tokens through the MLPs.
    Their own edges score little (EAP-IG credits only the direct write into a head, not the path through MLP 0),
    so the embeddings' best edge comes first, then the growth from the logits.
    """
    heads = loaded.facts.num_heads
    logits = len(passes.senders)
    score = shares.tolist()  # one host copy: the loops below read every edge's score
    positive = [e for e in edges if score[e[0]][e[1]] > 0]
    into: dict[int, list[Edge]] = {}  # node (1 + layer·H + head, or the logits) -> edges whose receiver reads it
    for edge in positive:
        receiver = passes.receivers[edge[1]]
        for node in [1 + layer * heads + head for layer, head in _receiver_heads(loaded, receiver)] or [logits]:
            into.setdefault(node, []).append(edge)
    order: list[Edge] = []
    inside: set[Edge] = set()
    embedded = [e for e in positive if e[0] == 0]  # sender 0: the embeddings
    if embedded:
        first = max(embedded, key=lambda e: score[e[0]][e[1]])
        order.append(first)
        inside.add(first)
    live: set[int] = set()
    waiting: list[tuple[float, Edge]] = []

    def join(node: int) -> None:
        if node not in live:
            live.add(node)
            for edge in into.get(node, []):
                heapq.heappush(waiting, (-score[edge[0]][edge[1]], edge))

    join(logits)
    while waiting and len(order) < count:
        _, edge = heapq.heappop(waiting)
        if edge in inside:
            continue
        order.append(edge)
        inside.add(edge)
        join(edge[0])
    rest = sorted((e for e in edges if e not in inside), key=lambda e: -abs(score[e[0]][e[1]]))
    return (order + rest)[:count]


def _first_reaching(values: list[float], target: float) -> tuple[int, float]:
    """Sort key of a ranked curve: the first index reaching ``target`` (len: never), then the best value."""
    reaching = [i for i, v in enumerate(values) if v >= target]
    return (reaching[0] if reaching else len(values), -max(values))


def find_circuit(inspector: Inspector, args: FindCircuitInput) -> CircuitReport:
    """Score every edge by EAP-IG, prune to the fewest ranked edges reaching ``target`` faithfulness, and size
    the curve against random edge sets of the same sizes."""
    loaded = inspector.model(args.model)
    if not loaded.facts.is_language_model:
        raise InvalidInputError(f"model {loaded.name!r} has no next-token head; find_circuit needs a language model")
    clean, corrupted = encode_pair(inspector, loaded, args.clean, args.corrupted)
    metric = LogitDifference(loaded, args.answer, args.wrong)
    passes = inspector.edge_attribution(loaded, clean, corrupted, metric, steps=args.steps)
    assert metric.tokens is not None  # the pass called the metric
    answer, wrong = metric.tokens
    ld_clean = float(passes.clean_logits[answer] - passes.clean_logits[wrong])
    ld_corrupted = float(passes.corrupted_logits[answer] - passes.corrupted_logits[wrong])
    threshold = minimum_gap(passes.clean_logits)
    gap = ld_clean - ld_corrupted
    if abs(gap) < threshold:
        msg = (
            f"clean and corrupted give logit differences {ld_clean:.4g} and {ld_corrupted:.4g}, {abs(gap):.3g} "
            f"apart: below {threshold:.3g}, too small to state fractions of; corrupt the information the answer "
            "depends on, or choose answer/wrong tokens that differ"
        )
        raise InvalidInputError(msg, field="corrupted")
    first = first_difference(clean, corrupted)
    shares = passes.scores / gap
    valid = passes.valid.nonzero().tolist()
    magnitude = shares.abs()
    edges_all = [(int(s), int(r)) for s, r in valid]
    order = sorted(edges_all, key=lambda e: -float(magnitude[e]))
    orderings: dict[Ranking, list[Edge]] = {
        "|score|": order[:RANKED],
        "score": sorted(edges_all, key=lambda e: -float(shares[e]))[:RANKED],
    }
    orderings["paths"] = _path_order(loaded, passes, shares, edges_all, len(order[:RANKED]))
    sizes = curve_sizes(len(order[:RANKED]))
    generator = random.Random(SEED)
    draws = [[generator.sample(order, k) for _ in range(DRAWS)] for k in sizes]
    sets = [ranked[:k] for ranked in orderings.values() for k in sizes] + [d for per in draws for d in per] + [[]]
    numbers = (answer, wrong, ld_clean, ld_corrupted)
    values, method = _edge_faithfulness(inspector, loaded, passes, clean, sets, numbers)
    if values is None:
        values = _faithfulness(inspector, loaded, passes, clean, first, sets, numbers)
        method = NODE_LEVEL.format(why=method)
    count = len(sizes)
    curves = {name: values[i * count : (i + 1) * count] for i, name in enumerate(orderings)}
    random_values, empty = values[len(orderings) * count : -1], values[-1]
    ranking = min(orderings, key=lambda name: _first_reaching(curves[name], args.target))
    ranked, ranked_values = orderings[ranking], curves[ranking]
    curve = []
    for i, k in enumerate(sizes):
        drawn = Baseline(tuple(random_values[i * DRAWS : (i + 1) * DRAWS]))
        curve.append(
            CurvePoint(
                edges=k,
                heads=len(_nodes(loaded, passes, ranked[:k])),
                faithfulness=ranked_values[i],
                random_mean=drawn.mean,
                random_spread=drawn.spread,
            )
        )
    reaching = [i for i, v in enumerate(ranked_values) if v >= args.target]
    chosen = reaching[0] if reaching else max(range(len(sizes)), key=lambda i: ranked_values[i])
    size = sizes[chosen]
    above = sum(1 for e in order[:RANKED] if float(magnitude[e]) >= THRESHOLD)
    listed = ranked[:size] + [e for e in order[:above] if e not in ranked[:size]]
    # cut with the circuit's edges first, then listed by |score| (the path order starts with a weak embeddings edge)
    listed = sorted(listed[: args.max_edges], key=lambda e: -float(magnitude[e]))
    decode = loaded.tokenizer.decode
    edges = [_edge(loaded, passes, e, float(shares[e]), e in ranked[:size]) for e in listed]
    nodes = _graph_nodes(loaded, passes, listed)
    report = CircuitReport(
        model=loaded.name,
        summary=summary(edges, curve[chosen], bool(reaching), args.target, str(decode([answer])), empty),
        findings=findings(edges),
        tokens=clean.length,
        answer=str(decode([answer])),
        wrong=str(decode([wrong])),
        logit_difference_clean=ld_clean,
        logit_difference_corrupted=ld_corrupted,
        steps=passes.steps,
        gradient_dtype=passes.gradient_dtype,
        faithfulness_method=method,
        edges_scored=len(order),
        target=args.target,
        reached=bool(reaching),
        ranking=ranking,
        circuit_edges=size,
        faithfulness=ranked_values[chosen],
        empty_circuit=empty,
        random_draws=DRAWS,
        threshold=THRESHOLD,
        nodes=nodes,
        edges=edges,
        curve=curve,
        next_calls=_next_calls(loaded, args, nodes),
    )
    if args.png:
        report.png_path, report.html_path = _write_pictures(inspector, loaded, args, report)
    return report


def _write_pictures(
    inspector: Inspector, loaded: LoadedModel, args: FindCircuitInput, report: CircuitReport
) -> tuple[str, str]:
    """The graph as a PNG and as a standalone HTML page in the artifact folder (each written whole or not at all)."""
    digest = hashlib.sha256(f"{args.clean}\0{args.corrupted}\0{report.answer}\0{report.wrong}".encode()).hexdigest()
    stem = f"circuit-{loaded.name}-{digest[:10]}"
    title = f"{loaded.name}: circuit for {report.answer!r} over {report.wrong!r} ({report.circuit_edges} edges)"
    png = write_atomic(inspector.artifact_path(stem, ".png"), circuit_png(report.nodes, report.edges, title))
    page = circuit_html(report.nodes, report.edges, title, report.summary)
    return str(png), str(write_atomic(inspector.artifact_path(stem, ".html"), page))


def _edge(loaded: LoadedModel, passes: EdgePasses, edge: Edge, share: float, inside: bool) -> CircuitEdge:
    receiver = passes.receivers[edge[1]]
    sender, name = _sender_name(passes.senders[edge[0]]), _receiver_name(loaded, receiver)
    return CircuitEdge(
        sender=sender,
        receiver=name,
        kind=receiver.kind,  # type: ignore[arg-type]
        score=share,
        in_circuit=inside,
        sentence=sentence(sender, name, receiver.kind, share),
    )


def _graph_nodes(loaded: LoadedModel, passes: EdgePasses, edges: list[Edge]) -> list[CircuitNode]:
    found: dict[str, CircuitNode] = {}
    for s, r in edges:
        sender = passes.senders[s]
        if sender == EMBEDDINGS:
            found.setdefault("embeddings", CircuitNode(name="embeddings", kind="embeddings"))
        else:
            name = head_name(*sender)
            found.setdefault(name, CircuitNode(name=name, kind="head", layer=sender[0], heads=[sender[1]]))
        receiver = passes.receivers[r]
        name = _receiver_name(loaded, receiver)
        if receiver.kind == "direct":
            found.setdefault(name, CircuitNode(name=name, kind="logits"))
        else:
            kind: NodeKind = "kv_head" if name.startswith(f"L{receiver.layer}KV") else "head"
            heads = [h for _, h in _receiver_heads(loaded, receiver)]
            found.setdefault(name, CircuitNode(name=name, kind=kind, layer=receiver.layer, heads=heads))
    return list(found.values())


def _next_calls(loaded: LoadedModel, args: FindCircuitInput, nodes: list[CircuitNode]) -> list[NextCall]:
    heads = [f"{n.layer}.{h}" for n in nodes if n.layer is not None for h in n.heads][:6]
    calls = [
        NextCall(
            tool="patch_heads",
            arguments={
                "model": loaded.name,
                "clean": args.clean,
                "corrupted": args.corrupted,
                **{k: v for k, v in (("answer", args.answer), ("wrong", args.wrong)) if v is not None},
            },
            why="each head's own patching effect, sized against random heads",
        )
    ]
    if heads:
        calls.append(
            NextCall(
                tool="ablate_heads",
                arguments={"model": loaded.name, "text": args.clean, "heads": heads},
                why="removing the circuit's heads on the clean prompt should break its answer",
            )
        )
    return calls
