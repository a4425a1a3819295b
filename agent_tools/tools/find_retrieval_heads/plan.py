"""find_retrieval_heads' passes: one captured pass per haystack (top key of every head at the answer rows), then
mean ablations of the top heads and of random heads of the same count on every haystack."""

from __future__ import annotations

import statistics
from functools import partial

import torch
from torch import Tensor

from agent_tools.analysis.long_context import retrieval_hits, retrieval_score
from agent_tools.analysis.metrics import Baseline
from agent_tools.consumers.retrieval import TopKeyConsumer
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Encoded, Inspector, validate_text
from agent_tools.loading import LoadedModel
from agent_tools.long_context import DEFAULT_HAYSTACK, Haystack, build_haystack, check_haystack, needle_tokens
from agent_tools.runner import HeadSetAblation, mean_head_outputs
from agent_tools.runner.patching import row_bytes
from agent_tools.schemas import NextCall, head_label, rounded
from agent_tools.session import guarded
from agent_tools.settings import readable_size
from agent_tools.tools.find_retrieval_heads.models import (
    CausalCheck,
    FindRetrievalHeadsInput,
    FindRetrievalHeadsReport,
    RetrievalHead,
)
from agent_tools.tools.find_retrieval_heads.models import Haystack as HaystackRow
from agent_tools.tools.find_retrieval_heads.narrative import RetrievalNumbers, findings, summary, verdict

METHOD = (
    "Wu et al. (2024) retrieval score: the answer is appended after the question (teacher forced); at each answer "
    "token, a head scores a hit when its most-attended key lies in the needle and holds the token being produced. "
    "Score = hits / answer tokens, averaged over haystacks. It says where a head looks while copying, not that the "
    "copy depends on it: the causal check (mean ablation of the top heads vs random heads) tests that."
)


def _encoded(ids: Tensor) -> Encoded:
    row = ids[None]
    return Encoded(input_ids=row, attention_mask=torch.ones_like(row), tokens=[], offsets=[], text="")


def _cache_plan_arguments(loaded: LoadedModel, stacks: list[Haystack]) -> dict[str, object]:
    """plan_kv_cache on the longest needle-in-a-haystack prompt this call ran (as text: within the model's limit
    by construction), with a window of a quarter of it (at most plan_kv_cache's default 64) so some keys fall out."""
    longest = max(stacks, key=lambda hay: hay.length)
    text = loaded.tokenizer.decode(longest.ids.tolist(), skip_special_tokens=True)
    tokens = len(loaded.tokenizer(text)["input_ids"])
    return {"text": text, "sink": max(1, min(4, tokens // 8)), "window": max(1, min(64, tokens // 4))}


def _answer_scores(logits: Tensor, *, hay: Haystack) -> tuple[Tensor, ...]:
    """(B,) accuracy and (B,) mean log-probability of the answer tokens, from (B, K, V) logits of the last K
    positions (K = :func:`_kept`: the answer's queries are the last positions but one)."""
    offset = hay.length - logits.shape[1]
    queries = torch.tensor(hay.answer_queries, device=logits.device) - offset
    targets = hay.ids.to(logits.device)[queries + offset + 1]  # (A,)
    rows = logits[:, queries].float()  # (B, A, V)
    accuracy = (rows.argmax(-1) == targets).float().mean(-1)
    chosen = torch.log_softmax(rows, -1).gather(-1, targets.expand(rows.shape[0], -1)[..., None])[..., 0]
    return accuracy.double().cpu(), chosen.mean(-1).double().cpu()


def _kept(hay: Haystack) -> int:
    """Positions whose logits the answer scores read: from the first answer query to the end."""
    return hay.length - hay.answer_queries[0]


def _check(args: FindRetrievalHeadsInput, loaded: LoadedModel, inspector: Inspector) -> None:
    facts = loaded.facts
    if not facts.is_language_model or facts.is_encoder_decoder:
        msg = f"find_retrieval_heads needs a decoder-only causal LM that copies an answer; {loaded.name!r} is not"
        raise InvalidInputError(msg, field="model")
    bad = [d for d in args.depths if not 0.0 <= d <= 1.0]
    if bad:
        raise InvalidInputError(f"depths {bad} outside 0..1 (0: start of the haystack, 1: its end)", field="depths")
    heads = facts.num_layers * facts.num_heads
    if args.top_k >= heads:
        raise InvalidInputError(
            f"top_k {args.top_k} must be at most {heads - 1} (heads of the model - 1)", field="top_k"
        )
    held = row_bytes(loaded, max(args.lengths), output_positions=0)  # one ablated row of the longest haystack
    if held > inspector.memory_budget:
        most = max(1, max(args.lengths) * inspector.memory_budget // held)
        msg = (
            f"a haystack of {max(args.lengths)} tokens would hold about {readable_size(held)} per ablated row, "
            f"over the budget of {readable_size(inspector.memory_budget)}; use lengths <= {most}"
        )
        raise ResourceLimitError(msg, field="lengths")


def find_retrieval_heads(inspector: Inspector, args: FindRetrievalHeadsInput) -> FindRetrievalHeadsReport:
    """Score every head on needle-in-a-haystack prompts and test the top heads by ablation."""
    loaded = inspector.model(args.model)
    facts = loaded.facts
    _check(args, loaded, inspector)
    haystack = validate_text(args.text) if args.text is not None else DEFAULT_HAYSTACK
    pieces = needle_tokens(loaded, haystack, args.needle, args.answer, args.question)
    check_haystack(pieces, args.lengths, inspector.limit_for(loaded))
    stacks = [build_haystack(pieces, length, depth) for length in args.lengths for depth in args.depths]
    scores = []
    for hay in stacks:
        consumer = TopKeyConsumer(hay.answer_queries, facts.num_layers, facts.num_heads)
        inspector.run(loaded, _encoded(hay.ids), [consumer], need_output=False)  # no logits: scores only
        hits = [retrieval_hits(top, hay.answer_queries, hay.ids, hay.needle) for top in consumer.top]  # L × (H, A)
        scores.append(retrieval_score(torch.stack(hits)))  # (L, H)
    grid = torch.stack(scores)  # (N, L, H)
    mean, spread = grid.mean(0), grid.std(0, unbiased=False)
    order = [int(i) for i in mean.flatten().argsort(descending=True, stable=True)]
    top = [divmod(i, facts.num_heads) for i in order[: args.top_k]]
    rest = [divmod(i, facts.num_heads) for i in order[args.top_k :]]
    generator = torch.Generator().manual_seed(args.seed)
    draws = [
        [rest[int(i)] for i in torch.randperm(len(rest), generator=generator)[: args.top_k]]
        for _ in range(args.random_draws)
    ]

    # Every head set mean-ablated as one row of a batch beside the clean row, per haystack: each row joins at its
    # first ablated layer, and only the answer positions' logits are computed and kept.
    sets = [top, *draws]
    layers = sorted({layer for heads in sets for layer, _ in heads})
    rows = [HeadSetAblation(tuple(heads), "mean") for heads in sets]
    per_stack = []  # (clean row, ablated rows) of each haystack: each (accuracy, log-probability)
    for hay in stacks:
        ids = hay.ids[None]
        with guarded(loaded):
            means = mean_head_outputs(loaded, ids, layers)
        reduce = partial(_answer_scores, hay=hay)
        per_stack.append(
            inspector.ablated_rows(
                loaded, ids, rows, replacements={"mean": means}, reduce=reduce, logits_to_keep=_kept(hay)
            )
        )
    clean = [(float(c[0]), float(c[1])) for c, _ in per_stack]
    results = [
        (
            statistics.fmean(float(found[0][row]) for _, found in per_stack),
            statistics.fmean(float(found[1][row]) for _, found in per_stack),
        )
        for row in range(len(sets))
    ]
    (top_accuracy, top_logprob), random_results = results[0], results[1:]
    accuracy_clean = statistics.fmean(c[0] for c in clean)
    random_accuracy = Baseline(tuple(r[0] for r in random_results))  # mean ± sample sd over the draws
    labelled = [
        (layer, head, float(mean[layer, head]), float(spread[layer, head]))
        for layer, head in top
        if float(mean[layer, head]) > 0
    ]
    numbers = RetrievalNumbers(
        haystacks=len(stacks),
        lengths=args.lengths,
        depths=args.depths,
        top=labelled,
        accuracy_clean=accuracy_clean,
        accuracy_top=top_accuracy,
        accuracy_random=random_accuracy.mean,
        accuracy_random_sd=random_accuracy.spread,
        draws=args.random_draws,
    )
    heads = [
        RetrievalHead(
            layer=layer,
            head=head,
            score=float(mean[layer, head]),
            score_sd=float(spread[layer, head]),
            score_min=float(grid[:, layer, head].min()),
            score_max=float(grid[:, layer, head].max()),
        )
        for layer, head in (divmod(i, facts.num_heads) for i in order)
        if float(mean[layer, head]) > 0
    ]
    return FindRetrievalHeadsReport(
        model=loaded.name,
        summary=summary(numbers),
        findings=findings(numbers),
        method=METHOD,
        haystacks=[
            HaystackRow(
                length=hay.length,
                depth=hay.depth,
                needle_start=hay.needle[0],
                accuracy=clean[index][0],
                top_head_score=float(grid[index].max()),
            )
            for index, hay in enumerate(stacks)
        ],
        heads=heads,
        layer_scores=mean.amax(-1).tolist(),
        score_grid=[[rounded(float(v), 3) for v in row] for row in mean],
        causal=CausalCheck(
            ablated=[head_label(layer, head) for layer, head in top],
            accuracy_clean=accuracy_clean,
            accuracy_top_ablated=top_accuracy,
            accuracy_random_mean=numbers.accuracy_random,
            accuracy_random_sd=random_accuracy.spread,
            random_draws=args.random_draws,
            logprob_clean=statistics.fmean(c[1] for c in clean),
            logprob_top_ablated=top_logprob,
            logprob_random_mean=statistics.fmean(r[1] for r in random_results),
            verdict=verdict(numbers),
        ),
        next_calls=[
            NextCall(
                tool="plan_kv_cache",
                arguments={"model": loaded.name, **_cache_plan_arguments(loaded, stacks)},
                why="whether the retrieval heads are the ones that need the full KV cache on the longest haystack",
            )
        ],
    )
