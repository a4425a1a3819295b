"""Evidence beside the attention shares of a trace: what the answer *depends on*, not only what it *reads*.

Attention share is not influence (Jain & Wallace 2019; Wiegreffe & Pinter 2019). For the content segments of a
traced prompt this module adds, through the inspector:

* **causal effects** — the answer's teacher-forced log-probability with the segment removed, and replaced by
  neutral tokens of the same length (removal also shifts positions, replacement does not);
* **gradient attribution** — integrated gradients and gradient × input of the answer's log-probability w.r.t.
  the segment's input embeddings, from a baseline where every content token is the neutral token;

and measures how the four views (attention, value-weighted share, causal effect, gradient) rank the segments.
:func:`prepare` validates a request before any pass (bad input is refused before the model runs); :func:`gather`
runs the checks after the traced pass; :func:`verdict` ranks and compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agent_tools.analysis.attribution import (
    deciding_step,
    logprob_changes,
    rank_agreement,
    segment_sums,
    spearman,
    top_index,
)
from agent_tools.consumers.collapse import output_grams_for
from agent_tools.errors import AttentionToolError, InvalidInputError, ResourceLimitError
from agent_tools.inspector import Inspector
from agent_tools.loading import LoadedModel
from agent_tools.prompt_segments import CONTENT_KINDS, SegmentedPrompt
from agent_tools.runner.attribution import InputGradients, SegmentVariant, input_embeddings, segment_ablations
from agent_tools.segment_attribution import SegmentCheck, choice_for_trace, segment_check, unchecked_note
from agent_tools.session import guarded
from agent_tools.traced_prompt.answer import measured_ids
from agent_tools.traced_prompt.measure import TracedPrompt, TraceNumbers
from agent_tools.traced_prompt.models import AGREEMENT_RHO, CHECKS, DEFAULT_CHECKS, NEGLIGIBLE_NATS, Check, Direction

NEUTRAL_CANDIDATES = (" ", ".")


@dataclass(frozen=True)
class EvidenceRequest:
    """What a trace was asked to check. ``explicit``: the caller named the checks (so a check that cannot run is
    an error), rather than taking the default (where it is skipped with a note)."""

    checks: tuple[Check, ...] = DEFAULT_CHECKS
    explicit: bool = False
    answer: str | None = None
    neutral_token: str | None = None
    ig_steps: int = 32
    exclude_filler: bool = True

    @classmethod
    def of(cls, args: Any) -> EvidenceRequest:
        """A request from a tool's arguments (``checks``, ``answer``, ``neutral_token``, ``ig_steps``,
        ``exclude_filler``: trace_prompt_attention's and compare_prompts'); a repeated check is refused."""
        checks: Sequence[Check] | None = args.checks
        if checks is not None and len(set(checks)) != len(checks):
            msg = f"checks lists a check twice; give each of {', '.join(CHECKS)} at most once"
            raise InvalidInputError(msg, field="checks")
        chosen: tuple[Check, ...] = DEFAULT_CHECKS if checks is None else tuple(c for c in CHECKS if c in checks)
        return cls(chosen, checks is not None, args.answer, args.neutral_token, args.ig_steps, args.exclude_filler)


@dataclass(frozen=True)
class Prepared:
    """A request validated against a segmented prompt: the neutral token, the given answer's ids, which checks
    will run and why not."""

    prompt: SegmentedPrompt
    request: EvidenceRequest
    causal: bool
    gradient: bool
    value_grams: dict[int, torch.Tensor] | None
    neutral_id: int | None
    answer_ids: list[int] | None
    notes: list[str] = field(default_factory=list)


def _single_token(loaded: LoadedModel, text: str) -> int | None:
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    return int(ids[0]) if len(ids) == 1 else None


def neutral_token(loaded: LoadedModel, text: str | None) -> int:
    """The token a segment is replaced with: the one given (it must be one token), else a space, '.', unk or pad."""
    if text is not None:
        found = _single_token(loaded, text)
        if found is None:
            count = len(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
            msg = f"neutral_token {text!r} is {count} tokens for {loaded.name!r}; give text that is exactly one token"
            raise InvalidInputError(msg, field="neutral_token")
        return found
    for candidate in NEUTRAL_CANDIDATES:
        found = _single_token(loaded, candidate)
        if found is not None:
            return found
    for name in ("unk_token_id", "pad_token_id", "eos_token_id"):
        value = getattr(loaded.tokenizer, name, None)
        if isinstance(value, int):
            return value
    raise InvalidInputError(f"no neutral token found for {loaded.name!r}; give neutral_token", field="neutral_token")


def answer_ids(loaded: LoadedModel, text: str) -> list[int]:
    """The given answer's token ids (tokenised on its own, no special tokens), at least one."""
    ids = [int(i) for i in loaded.tokenizer(text, add_special_tokens=False)["input_ids"]]
    if not ids:
        raise InvalidInputError(
            "answer produced no tokens; give the answer text the model should write", field="answer"
        )
    return ids


def content_segments(prompt: SegmentedPrompt) -> list[int]:
    """Indices of the content segments that hold tokens: the ones causal and gradient checks measure."""
    return [i for i, s in enumerate(prompt.segments) if s.kind in CONTENT_KINDS and s.positions]


def _refuse_or_note(prepared_notes: list[str], explicit: bool, message: str, field: str = "checks") -> None:
    if explicit:
        raise InvalidInputError(message, field=field)
    prepared_notes.append(message)


def _whole_prompt(prompt: SegmentedPrompt) -> str:
    segments = content_segments(prompt)
    if len(segments) != 1:
        return ""
    segment = prompt.segments[segments[0]]
    first, last = min(segment.positions), max(segment.positions)
    return (
        f"segment {segment.name!r} covers the whole prompt (positions {first}..{last}): removing it leaves nothing "
        "to compare against; name at least two segments (segments=[{name, text}, ...]) or use chat messages, "
        "or ask for checks without 'causal'"
    )


def _grams(loaded: LoadedModel, notes: list[str]) -> dict[int, torch.Tensor] | None:
    try:
        grams = output_grams_for(loaded.model, range(loaded.facts.num_layers), loaded.facts.num_heads)
    except AttentionToolError as exc:
        notes.append(f"value-weighted shares skipped: {exc.message}")
        return None
    if any(g.is_meta for g in grams.values()):  # weights offloaded to disk exist only inside their module's forward
        notes.append("value-weighted shares skipped: some output projections are offloaded (not in memory)")
        return None
    return grams


def prepare(inspector: Inspector, loaded: LoadedModel, prompt: SegmentedPrompt, request: EvidenceRequest) -> Prepared:
    """Validate the request against the model and the segmented prompt before any pass runs."""
    notes: list[str] = []
    wants = set(request.checks)
    causal, gradient = "causal" in wants, "gradient" in wants
    if (causal or gradient) and not loaded.facts.is_language_model:
        _refuse_or_note(notes, request.explicit, f"model {loaded.name!r} has no next-token head: no answer to check")
        causal = gradient = False
    whole = _whole_prompt(prompt) if causal else ""
    if whole:
        _refuse_or_note(notes, request.explicit, whole, field="segments")
        causal = False
    neutral = neutral_token(loaded, request.neutral_token) if causal or gradient or request.neutral_token else None
    answer = answer_ids(loaded, request.answer) if request.answer is not None else None
    if answer is not None and prompt.encoded.length + len(answer) > inspector.limit_for(loaded):
        msg = f"prompt + answer are {prompt.encoded.length + len(answer)} tokens, over {inspector.limit_for(loaded)}"
        raise ResourceLimitError(msg, field="answer")
    if gradient:
        input_embeddings(loaded)  # refuses a model without float input embeddings before the pass
        inspector.check_gradient_budget(loaded, prompt.encoded.length + len(answer or [None]) - 1)
    grams = _grams(loaded, notes) if "value" in wants else None
    return Prepared(prompt, request, causal, gradient, grams, neutral, answer, notes)


# --- after the traced pass -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SegmentCausal:
    """Δ log p when the segment is removed (or replaced by neutral tokens): negative = the answer depends on it.
    The fields are :class:`~.models.CausalEffect`'s, which reports them with the deciding token's Δ."""

    first_token_removed: float
    first_token_neutral: float
    answer_removed: float
    answer_neutral: float
    top_token_changed_removed: bool
    top_token_changed_neutral: bool
    per_token_removed: tuple[float, ...] = ()  # (A,) Δ log p of each answer token, removed

    def on_token(self, step: int | None) -> float:
        """Δ log p of answer token ``step`` when removed (the whole answer's Σ when ``step`` is None)."""
        if step is None or not self.per_token_removed:
            return self.answer_removed
        return self.per_token_removed[step]


def direction(delta: float) -> Direction:
    """Which way removing a segment moves log p: down (the answer depends on it), up (it works against it)."""
    if delta < -NEGLIGIBLE_NATS:
        return "depends_on"
    if delta > NEGLIGIBLE_NATS:
        return "works_against"
    return "negligible"


@dataclass(frozen=True)
class GradientNumbers:
    """The gradient check per content segment, and the run it sums (steps, log p at the input and at the
    baseline, convergence delta)."""

    integrated: dict[int, float]  # segment -> Σ IG over its tokens
    times_input: dict[int, float]
    run: InputGradients


@dataclass
class Evidence:
    """What the checks measured, per segment index of the traced prompt."""

    answer_ids: list[int]
    source: str  # "model" or "given"
    clean: torch.Tensor | None = None  # (A,) clean log-probabilities of the answer tokens
    causal: dict[int, SegmentCausal] = field(default_factory=dict)
    # causal check by attribution (more than 4 segments): the check, and the segment index of each of its rows
    attribution: tuple[SegmentCheck, list[int]] | None = None
    gradient: GradientNumbers | None = None
    notes: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)


def model_answer(loaded: LoadedModel, traced: TracedPrompt) -> list[int]:
    """The model's own answer: its top next token (target 'last') or what it generated, less the stop token."""
    if traced.target == "generate" and traced.generated_ids:
        stopped = traced.generation.stopped if traced.generation is not None else None
        return measured_ids(loaded, list(traced.generated_ids), stopped)
    assert traced.answer_logits is not None
    return [int(traced.answer_logits.argmax())]


def _variants(prompt: SegmentedPrompt, segments: list[int], neutral: int) -> list[SegmentVariant]:
    ids = prompt.encoded.input_ids[0].tolist()
    variants = []
    for index in segments:
        taken = set(prompt.segments[index].positions)
        removed = [t for p, t in enumerate(ids) if p not in taken]
        replaced = [neutral if p in taken else t for p, t in enumerate(ids)]
        variants.append(SegmentVariant(min(taken), removed, replaced))
    return variants


def _causal(
    inspector: Inspector, loaded: LoadedModel, traced: TracedPrompt, prepared: Prepared, evidence: Evidence
) -> None:
    """Each content segment removed and replaced by neutral tokens: the answer's log-probability changes."""
    prompt, neutral = traced.prompt, prepared.neutral_id
    assert neutral is not None
    candidates, ids = content_segments(prompt), prompt.encoded.input_ids[0].tolist()
    variants = _variants(prompt, candidates, neutral)
    neutral_ids = [v.neutral for v in variants]
    choice = choice_for_trace(inspector, loaded, ids, evidence.answer_ids, neutral_ids, evidence.notes)
    rows = choice.chosen if choice is not None else list(range(len(candidates)))  # the rest only estimated
    segments = [candidates[r] for r in rows]
    with guarded(loaded):
        result = segment_ablations(
            loaded, ids, evidence.answer_ids, [variants[r] for r in rows], traced=traced.answer_pass
        )
    evidence.clean = result.clean
    first_removed, whole_removed = logprob_changes(result.removed, result.clean)  # (n,) each
    first_neutral, whole_neutral = logprob_changes(result.neutral, result.clean)
    for row, index in enumerate(segments):
        evidence.causal[index] = SegmentCausal(
            first_token_removed=float(first_removed[row]),
            first_token_neutral=float(first_neutral[row]),
            answer_removed=float(whole_removed[row]),
            answer_neutral=float(whole_neutral[row]),
            top_token_changed_removed=result.removed_top[row] != result.clean_top,
            top_token_changed_neutral=result.neutral_top[row] != result.clean_top,
            per_token_removed=tuple((result.removed[row] - result.clean).tolist()),
        )
    if choice is not None:
        exact = {r: float(whole_neutral[k]) for k, r in enumerate(rows)}
        evidence.attribution = segment_check(choice, exact), candidates
        skipped = [prompt.segments[i].name for i in candidates if i not in evidence.causal]
        evidence.notes.append(unchecked_note(skipped, evidence.attribution[0]))
    evidence.checks.append("causal")


def _gradient(
    inspector: Inspector, loaded: LoadedModel, traced: TracedPrompt, prepared: Prepared, evidence: Evidence
) -> None:
    """Integrated gradients from every content token set to the neutral token, summed per segment."""
    prompt, neutral = traced.prompt, prepared.neutral_id
    assert neutral is not None
    segments = content_segments(prompt)
    ids = prompt.encoded.input_ids[0].tolist()
    taken = {p for index in segments for p in prompt.segments[index].positions}
    baseline = [neutral if p in taken else t for p, t in enumerate(ids)]
    answer = evidence.answer_ids
    result = inspector.input_gradients(
        loaded, ids + answer[:-1], baseline + answer[:-1], answer, steps=prepared.request.ig_steps
    )
    index = prompt.segment_index()
    count = len(prompt.segments)
    integrated = segment_sums(result.integrated[: len(ids)], index, count)
    times = segment_sums(result.gradient_x_input[: len(ids)], index, count)
    evidence.gradient = GradientNumbers(
        {i: float(integrated[i]) for i in segments}, {i: float(times[i]) for i in segments}, result
    )
    evidence.checks.append("gradient")


def gather(inspector: Inspector, loaded: LoadedModel, traced: TracedPrompt, prepared: Prepared) -> Evidence:
    """Run the checks that were prepared, after the traced pass (it gave the model's own answer)."""
    if prepared.answer_ids is not None:
        evidence = Evidence(list(prepared.answer_ids), "given", notes=list(prepared.notes))
    elif traced.answer_logits is not None:
        evidence = Evidence(model_answer(loaded, traced), "model", notes=list(prepared.notes))
    else:
        return Evidence([], "model", notes=list(prepared.notes))
    if prepared.causal:
        _causal(inspector, loaded, traced, prepared, evidence)
    if prepared.gradient:
        _gradient(inspector, loaded, traced, prepared, evidence)
    if traced.value_shares is not None:
        evidence.checks.append("value")
    return evidence


# --- ranking and agreement --------------------------------------------------------------------------------------
MEASURE_NAMES = {
    "attention": "attention share",
    "value": "value-weighted share",
    "causal": "|Δ log p| removed",
    "removal": "Δ log p removed (whole answer)",
    "gradient": "integrated gradients",
}


@dataclass(frozen=True)
class Verdict:
    """How the measures rank the named segments, what moves the deciding token, and whether attention agrees.

    Rankings and the headline are over the *named* segments (spans the caller named, whole messages); gaps (the
    unnamed text between named spans) and text the template inserted are measured but reported apart.
    """

    segments: list[int]  # the named segments compared
    apart: list[int]  # gaps and inserted text: measured, reported apart
    measures: dict[str, list[float]]  # measure -> value per compared segment (larger = more)
    agreement: list[tuple[str, str, float | None, bool]]  # (a, b, Spearman ρ, same top)
    deciding: int | None  # the answer token the named segments' removal moves most (None without causal)
    depends_on: list[int]  # named segments whose removal lowers the deciding token's log p, most first
    works_against: list[int]  # ... whose removal raises it, most first
    moves_most: int | None  # the named segment with the largest |Δ| either way
    read_first: int | None  # the named segment attention ranks first
    agree: bool | None  # attention and removal: the same top and ρ ≥ AGREEMENT_RHO
    checked: list[int] = field(default_factory=list)  # the named segments ablated exactly (all but attribution's rest)


def verdict(traced: TracedPrompt, numbers: TraceNumbers, evidence: Evidence) -> Verdict:
    """Rank the named segments by each measure that ran, find the deciding token, and compare the rankings."""
    content = [i for i in content_segments(traced.prompt) if traced.prompt.segments[i].kind != "generated"]
    segments = [i for i in content if numbers.tiers[i] == "named"] or content
    apart = [i for i in content if i not in segments]
    measures = {"attention": [numbers.views["named"][i] for i in segments]}
    if "value" in numbers.views:
        measures["value"] = [numbers.views["value"][i] for i in segments]
    deciding: int | None = None
    depends: list[int] = []
    against: list[int] = []
    moves: int | None = None
    causal = evidence.causal
    checked = [i for i in segments if i in causal]  # all, unless attribution left some unablated
    if causal and checked:
        per_token = [list(causal[i].per_token_removed) or [causal[i].answer_removed] for i in checked]
        deciding = deciding_step(torch.tensor(per_token, dtype=torch.float64))  # (S, A) -> step
        delta = {i: causal[i].on_token(deciding) for i in checked}
        depends = sorted((i for i in checked if direction(delta[i]) == "depends_on"), key=lambda i: delta[i])
        against = sorted((i for i in checked if direction(delta[i]) == "works_against"), key=lambda i: -delta[i])
        moves = checked[top_index([abs(delta[i]) for i in checked])]
        if checked == segments:
            measures["causal"] = [abs(delta[i]) for i in segments]
    if evidence.gradient is not None:
        measures["gradient"] = [evidence.gradient.integrated[i] for i in segments]
        if causal and checked == segments:
            measures["removal"] = [-causal[i].answer_removed for i in segments]  # support, as IG's sign
    read_first = segments[top_index(measures["attention"])] if segments else None
    agreement = _agreement(measures) if len(segments) >= 2 else []
    if causal and checked != segments and len(checked) >= 2:  # the ablated segments only
        subset = _agreement(_checked_measures(segments, checked, measures, delta, causal))
        agreement += [row for row in subset if {"causal", "removal"} & set(row[:2])]
    agree: bool | None = None
    if moves is not None and read_first is not None and len(checked) >= 2:
        rho = next((r for a, b, r, _ in agreement if (a, b) == ("attention", "causal")), None)
        agree = read_first == moves and (rho is None or rho >= AGREEMENT_RHO)
    return Verdict(segments, apart, measures, agreement, deciding, depends, against, moves, read_first, agree, checked)


def _checked_measures(
    segments: list[int], checked: list[int], measures: dict[str, list[float]], delta: dict[int, float], causal: dict
) -> dict[str, list[float]]:
    """The measures over the ablated segments only, with |Δ| and removal's Δ (rank agreement needs them paired)."""
    rows = [segments.index(i) for i in checked]
    kept = {name: [values[r] for r in rows] for name, values in measures.items()}
    kept["causal"] = [abs(delta[i]) for i in checked]
    if "gradient" in kept:
        kept["removal"] = [-causal[i].answer_removed for i in checked]
    return kept


AGREEMENT_PAIRS = (("attention", "causal"), ("value", "causal"), ("attention", "value"), ("gradient", "removal"))


def _agreement(measures: dict[str, list[float]]) -> list[tuple[str, str, float | None, bool]]:
    """The pairs worth comparing: attention and value against |Δ| removed, and gradients against removal's Δ on
    the same quantity (the whole answer's log p)."""
    rows = []
    for a, b in AGREEMENT_PAIRS:
        if a in measures and b in measures:
            rows.append((a, b, spearman(measures[a], measures[b]), top_index(measures[a]) == top_index(measures[b])))
    if not rows:
        rows = rank_agreement({k: v for k, v in measures.items() if k in ("attention", "value")})
    return rows
