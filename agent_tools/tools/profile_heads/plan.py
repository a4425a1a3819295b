"""profile_heads' passes: the text pass as a shareable plan; its finish runs the held-out texts, the probes and the
ablation checks.

Each pass streams every layer's maps into a :class:`~agent_tools.consumers.roles.RoleScoreConsumer` (and a
:class:`~agent_tools.consumers.roles.PatternScoreConsumer` for named patterns), which keeps a few sums per head and
drops the maps; ``finish`` turns the sums into scores, classifies every head and ranks the heads of each role by
their mean over the role's inputs (texts or probes). The ablation checks mean-ablate each top head and as many
random heads on one input, all as rows of one batched forward. Every forward goes through the inspector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from agent_tools.analysis.ablation import cosine_change
from agent_tools.analysis.heads import (
    DEFAULT_LOCAL_WINDOW,
    DEFAULT_THRESHOLDS,
    HEAD_ROLES,
    NAMED_PATTERNS,
    ROLES,
    TEXT_ROLES,
    HeadRole,
    KeyReader,
    MeasuredOn,
    Name,
    PatternName,
    SequenceLayout,
    classify_head,
    copy_losses,
    copy_losses_from,
    role_verdict,
    top_heads,
)
from agent_tools.analysis.metrics import Baseline, exceeds_baseline
from agent_tools.consumers.roles import (
    PatternScoreConsumer,
    RoleScoreConsumer,
    UserPattern,
    pattern_scores,
    role_scores,
)
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.families import ModelFacts
from agent_tools.inspector import Encoded, Inspector, PassPlan
from agent_tools.loading import LoadedModel
from agent_tools.probes import Probe, build_probe
from agent_tools.runner import model_output
from agent_tools.runner.patching import HeadPatch, recorded_run
from agent_tools.runner.readout import PositionLosses, pooled_hidden
from agent_tools.schemas import head_label
from agent_tools.session import guarded
from agent_tools.stack_input import on_stack
from agent_tools.tools.profile_heads.models import (
    HELD_OUT_TEXTS,
    SAMPLE_TEXT,
    AblationEvidence,
    EvidenceMetric,
    HeadProfile,
    HeadProfiles,
    InductionCheck,
    PatternReport,
    PatternTop,
    ProbeInfo,
    ProfileHeadsInput,
    RoleReport,
    TextSource,
    TopHead,
)
from agent_tools.tools.profile_heads.narrative import (
    InductionLosses,
    induction_finding,
    next_calls,
    role_finding,
    summary,
    why_unmeasured,
)

Scores = dict[int, dict[HeadRole, torch.Tensor]]  # layer -> role -> (H,) scores
Head = tuple[int, int]  # (layer, head)
_N = TypeVar("_N", bound=str)  # a role or a pattern name
# The smallest rise that counts as an effect, per metric, when the random heads all give the same number.
EFFECT_FLOORS: dict[EvidenceMetric, float] = {
    "second_copy_loss_change": 0.01,
    "next_token_loss_change": 0.01,
    "pooled_cosine_change": 1e-4,
}


def profile_heads(inspector: Inspector, args: ProfileHeadsInput) -> HeadProfiles:
    """Score every head (or the layers asked) for each role, classify it, and list each role's top heads."""
    return inspector.execute(plan_profile_heads(inspector, args))


def _check_names(names: Sequence[_N] | None, valid: Sequence[_N], field: str, *, default: Sequence[_N]) -> list[_N]:
    """The roles or patterns asked for, each once, in ``valid``'s order (``default`` when omitted); an unknown or
    repeated name, or an empty list where the default is not empty, is refused with the valid names (a caller that
    skips pydantic's enum still gets a tool error)."""
    if names is None:
        return list(default)
    what = field.removesuffix("s")
    if not names and default:
        raise InvalidInputError(f"{field} is empty; give some of {', '.join(valid)} or omit it", field=field)
    unknown = [name for name in names if name not in valid]
    if unknown:
        msg = f"unknown {what} {unknown[0]!r}; valid {field}: {', '.join(valid)}"
        raise InvalidInputError(msg, field=field)
    if len(set(names)) != len(names):
        duplicates = sorted({name for name in names if names.count(name) > 1})
        raise InvalidInputError(f"{field} lists {duplicates} more than once; give each {what} once", field=field)
    return [name for name in valid if name in names]


@dataclass(frozen=True)
class _TextPass:
    """One text's pass: its tokens, layout, role sums and (named) pattern sums."""

    encoded: Encoded
    layout: SequenceLayout
    consumer: RoleScoreConsumer
    patterns: PatternScoreConsumer | None

    @property
    def consumers(self) -> list[RoleScoreConsumer | PatternScoreConsumer]:
        return [self.consumer] + ([self.patterns] if self.patterns is not None else [])


def _text_layout(
    loaded: LoadedModel, encoded: Encoded, skip_queries: int | None, *, local_window: int = DEFAULT_LOCAL_WINDOW
) -> SequenceLayout:
    """The text's layout: its tokens, which are special, the model's mask and the queries skipped."""
    tokens = encoded.tokens
    return SequenceLayout.for_text(
        [t.text for t in tokens],
        [t.special for t in tokens],
        causal=loaded.facts.is_causal,
        skip_queries=skip_queries,
        local_window=local_window,
    )


def _text_pass(
    loaded: LoadedModel, encoded: Encoded, args: ProfileHeadsInput, roles: list[HeadRole], patterns: list[PatternName]
) -> _TextPass:
    layout = _text_layout(loaded, encoded, args.skip_queries, local_window=args.local_window)
    built = {name: NAMED_PATTERNS[name].build(layout, encoded.input_ids[0]) for name in patterns}
    readers: dict[str, KeyReader] = {n: reader for n, reader in built.items() if reader is not None}  # None: no key
    heads = loaded.facts.num_heads
    pattern_consumer = PatternScoreConsumer(readers, heads, skip_queries=layout.skip_queries) if readers else None
    return _TextPass(encoded, layout, RoleScoreConsumer(layout, roles, heads), pattern_consumer)


STACK_REFUSAL = (
    "profile_heads runs its text, its induction probe and its ablations through one sequence; on an "
    "encoder–decoder that is the encoder. Cross-attention reads another sequence, so positional roles (previous "
    "token, induction, local) have no meaning there, and decoder roles are not measured by this tool: look at "
    "the decoder or cross stack with show_attention or diagnose_collapse"
)


@dataclass(frozen=True)
class _Call:
    """The call: its inspector and arguments, the checked model, layers, roles and patterns, the stack's layer count
    (random heads), and the text's pass (None when no text role or pattern is asked)."""

    inspector: Inspector
    args: ProfileHeadsInput
    loaded: LoadedModel
    layers: list[int]
    roles: list[HeadRole]
    patterns: list[PatternName]
    num_layers: int
    text: _TextPass | None = None


def plan_profile_heads(inspector: Inspector, args: ProfileHeadsInput) -> PassPlan[HeadProfiles]:
    """The text pass (role and pattern sums over the text) as a plan; its finish runs the held-out texts, the
    probe pass and the ablation checks."""
    loaded = inspector.model(args.model)
    stack = inspector.attention_stack(loaded, args.attention)
    inspector.require_stack(loaded, stack, ("self", "encoder"), STACK_REFUSAL)
    layers = inspector.check_layers(loaded, args.layers, stack, "layer")
    roles = _check_names(args.roles, HEAD_ROLES, "roles", default=HEAD_ROLES)
    patterns = _check_names(args.patterns, list(NAMED_PATTERNS), "patterns", default=[])
    call = _Call(inspector, args, loaded, layers, roles, patterns, stack.num_layers)
    text_roles = [r for r in roles if r in TEXT_ROLES]
    if not text_roles and not patterns:
        return PassPlan(loaded, None, [], lambda _output: _profile(call))
    encoded = inspector.encode(loaded, args.text if args.text is not None else SAMPLE_TEXT)
    text = _text_pass(loaded, encoded, args, text_roles, patterns)
    call = replace(call, text=text)
    # The ablation checks record their own clean run: the text pass never needs the model's output.
    return PassPlan(
        loaded, encoded, list(text.consumers), lambda _output: _profile(call), layers=layers, need_output=False
    )


@dataclass
class _Measured:
    """What the passes produced: per-head scores, each role's mean and spread over its inputs, the probe."""

    scores: Scores  # text roles: on the text; probe roles: the mean over the seeds
    means: Scores = field(default_factory=dict)  # every role: the mean over its inputs (texts or seeds)
    spreads: Scores = field(default_factory=dict)  # population std over the inputs (two or more)
    inputs: dict[HeadRole, int] = field(default_factory=dict)
    layouts: dict[MeasuredOn, SequenceLayout] = field(default_factory=dict)
    probe: Probe | None = None
    probe_output: torch.Tensor | None = None  # the seed-0 probe's logits (for the induction check)
    language_model: bool = False
    seeds: list[int] = field(default_factory=list)
    held_out: list[_TextPass] = field(default_factory=list)


def _aggregate(
    runs: Sequence[Mapping[int, Mapping[Name, torch.Tensor]]], names: Sequence[Name], layers: Iterable[int]
) -> tuple[dict[int, dict[Name, torch.Tensor]], dict[int, dict[Name, torch.Tensor]], dict[Name, int]]:
    """Each name's (H,) mean and population std (two runs or more) over the runs (texts or probe seeds) that
    measured it, layer by layer, and how many runs that is: (means, spreads, inputs)."""
    means: dict[int, dict[Name, torch.Tensor]] = {}
    spreads: dict[int, dict[Name, torch.Tensor]] = {}
    inputs: dict[Name, int] = {}
    for layer in layers:
        for name in names:
            values = [run[layer][name] for run in runs if layer in run and name in run[layer]]
            if not values:
                continue
            stacked = torch.stack(values)  # (runs, H)
            means.setdefault(layer, {})[name] = stacked.mean(0)
            if len(values) > 1:
                spreads.setdefault(layer, {})[name] = stacked.std(0, correction=0)
            inputs[name] = len(values)
    return means, spreads, inputs


def _profile(call: _Call) -> HeadProfiles:
    """The plan's finish: held-out texts, probes, every head's profile, each role's top heads, the checks."""
    args, loaded, roles, text = call.args, call.loaded, call.roles, call.text
    facts = loaded.facts
    thresholds = {**DEFAULT_THRESHOLDS, **(args.thresholds.given() if args.thresholds else {})}
    measured = _measure(call)
    scored = [r for r in roles if any(r in per_role for per_role in measured.scores.values())]
    heads = _head_profiles(measured, call.layers, scored, thresholds, facts)
    primary = {(profile.layer, profile.head): profile.primary_role for profile in heads}
    counts = {role: _ablated_count(args, role, measured.language_model) for role in scored}
    wanted = {r: [(la, he) for la, he, _ in top_heads(measured.means, r, counts[r])] for r in scored}
    evidence = _Evidence(call, measured).measure(wanted)
    role_reports = [
        _role_report(role, measured, thresholds, primary, evidence, top_k=args.top_k, ablate_top=counts[role])
        for role in scored
    ]
    losses = None
    if args.induction_check and "induction" in scored:
        on_probe = [h for r, hs in wanted.items() if _evidence_input(r) == "probe" for h in hs]
        losses = _induction_losses(call, measured, tested=on_probe)
    source: TextSource = "user" if args.text is not None else "sample"
    report = HeadProfiles(
        model=loaded.name,
        summary="",
        findings=[role_finding(r) for r in role_reports] + ([induction_finding(losses)] if losses is not None else []),
        layers=call.layers,
        num_heads=facts.num_heads,
        text_source=source,
        text_tokens=text.encoded.length if text is not None else None,
        held_out_texts=len(measured.held_out),
        probe=_probe_info(measured.probe, measured.seeds),
        thresholds={r: thresholds[r] for r in roles},
        unmeasured={r: why_unmeasured(r, text.layout if text else None) for r in roles if r not in scored},
        roles=role_reports,
        induction_check=_induction_check(losses),
        patterns=_pattern_reports(call.patterns, text, measured, top_k=args.top_k),
        heads=heads,
    )
    report.attention = facts.stack().name
    said = on_stack(report.attention, summary(report))
    return report.model_copy(update={"summary": said, "next_calls": next_calls(args, report)})


def _ablated_count(args: ProfileHeadsInput, role: HeadRole, language_model: bool) -> int:
    """How many of the role's top heads get an ablation check: as asked, or by default every listed head of a role
    with a check on a model with a next-token head (one batched forward), none of the others."""
    if args.ablate_top is not None:
        return args.ablate_top
    return args.top_k if ROLES[role].ablation_check is not None and language_model else 0


def _measure(call: _Call) -> _Measured:
    """The text's sums (from the shared pass), the held-out texts' passes, then the probe pass if a probe role is
    asked; every role's mean and spread over its inputs."""
    facts, text = call.loaded.facts, call.text
    measured = _Measured(scores={layer: {} for layer in call.layers})
    measured.language_model = facts.is_causal and facts.is_language_model
    text_roles = [r for r in call.roles if r in TEXT_ROLES]
    if text is not None:
        measured.layouts["text"] = text.layout
        for layer, per_role in text.consumer.scores().items():
            measured.scores[layer].update(per_role)
        measured.held_out = _held_out_passes(call, text_roles)
        runs = [p.consumer.scores() for p in (text, *measured.held_out)]
        _add(measured, runs, [r for r in text_roles if any(r in s for s in measured.scores.values())])
    probe_roles = [r for r in call.roles if ROLES[r].measured_on == "probe"]
    if probe_roles:
        _probe_pass(call, probe_roles, measured)
    return measured


def _add(
    measured: _Measured, runs: Sequence[Mapping[int, Mapping[HeadRole, torch.Tensor]]], roles: list[HeadRole]
) -> None:
    """Record the roles' means, spreads and input counts over the runs (text roles and probe roles are different
    roles)."""
    means, spreads, inputs = _aggregate(runs, roles, measured.scores)
    for layer, per_role in means.items():
        measured.means.setdefault(layer, {}).update(per_role)
    for layer, per_role in spreads.items():
        measured.spreads.setdefault(layer, {}).update(per_role)
    measured.inputs.update(inputs)


def _encode_fitting(inspector: Inspector, loaded: LoadedModel, text: str) -> Encoded | None:
    """A held-out text, shortened by whole words to what the model's positions allow (None: nothing fits)."""
    words = text.split()
    while words:
        try:
            return inspector.encode(loaded, " ".join(words))
        except ResourceLimitError:
            words = words[: len(words) * 2 // 3]
    return None


def _held_out_passes(call: _Call, roles: list[HeadRole]) -> list[_TextPass]:
    """The first ``held_out_texts`` built-in texts, each streamed into its own role and pattern sums."""
    passes = []
    for held_out in HELD_OUT_TEXTS[: call.args.held_out_texts]:
        if held_out == call.args.text:
            continue
        encoded = _encode_fitting(call.inspector, call.loaded, held_out)
        if encoded is None:
            continue
        one = _text_pass(call.loaded, encoded, call.args, roles, call.patterns)
        call.inspector.run(call.loaded, encoded, one.consumers, layers=call.layers, need_output=False)
        passes.append(one)
    return passes


def _probe_pass(call: _Call, roles: list[HeadRole], measured: _Measured) -> None:
    """Stream ``args.seeds`` seeded probes into the probe roles' sums (scores: their mean, with the spread); the
    first probe's output is kept for the induction check."""
    inspector, loaded, args = call.inspector, call.loaded, call.args
    runs = []
    for offset in range(args.seeds):
        probe = build_probe(inspector, loaded, args.probe_length, args.seed + offset)
        layout = SequenceLayout.for_probe(
            probe.encoded.length, start=probe.start, repeat_length=probe.repeat_length, causal=loaded.facts.is_causal
        )
        consumer = RoleScoreConsumer(layout, roles, loaded.facts.num_heads)
        first = offset == 0
        output = inspector.run(loaded, probe.encoded, [consumer], layers=call.layers, need_output=first)
        runs.append(consumer.scores())
        measured.seeds.append(args.seed + offset)
        if first:
            measured.probe_output = model_output(output)[0]
            measured.layouts["probe"] = layout
            measured.probe = probe
    _add(measured, runs, roles)
    for layer, per_role in measured.means.items():
        measured.scores[layer].update({r: v for r, v in per_role.items() if r in roles})


def _probe_info(probe: Probe | None, seeds: list[int]) -> ProbeInfo | None:
    if probe is None:
        return None
    return ProbeInfo(
        seed=seeds[0],
        seeds=list(seeds),
        repeat_length=probe.repeat_length,
        length=probe.encoded.length,
        first_copy_start=probe.start,
        preview=[t.text for t in probe.encoded.tokens[: probe.start + 8]],
    )


def _head_profiles(
    measured: _Measured, layers: list[int], roles: list[HeadRole], thresholds: dict[HeadRole, float], facts: ModelFacts
) -> list[HeadProfile]:
    """Every head's scores, primary role with its confidence, runner-up, and its probe scores' spread."""
    scores = measured.scores
    probe_spreads = {
        layer: {r: v for r, v in per_role.items() if ROLES[r].measured_on == "probe"}
        for layer, per_role in measured.spreads.items()
    }
    profiles = []
    for layer in layers:
        for head in range(facts.num_heads):
            head_scores = {r: float(scores[layer][r][head]) for r in roles if r in scores[layer]}
            verdict = classify_head(head_scores, thresholds)
            profiles.append(
                HeadProfile(
                    layer=layer,
                    head=head,
                    kv_head=facts.kv_head_of(head),
                    scores=head_scores,
                    primary_role=verdict.primary,
                    confidence=verdict.confidence,
                    runner_up=verdict.runner_up,
                    runner_up_score=verdict.runner_up_score,
                    score_spread={r: float(v[head]) for r, v in probe_spreads.get(layer, {}).items() if r in roles},
                )
            )
    return profiles


def _evidence_input(role: HeadRole) -> MeasuredOn:
    """Where a role's heads are ablated: its check's input (the probe), else where the role is measured."""
    return "probe" if ROLES[role].ablation_check == "probe_second_copy_loss" else ROLES[role].measured_on


@dataclass
class _Evidence:
    """Mean-ablation of single heads against random heads, per input: one recorded clean run gives every head's
    mean output, then one batched forward patches each tested head and each random head in a row of its own."""

    call: _Call
    measured: _Measured

    def measure(self, wanted: Mapping[HeadRole, list[Head]]) -> dict[tuple[MeasuredOn, int, int], AblationEvidence]:
        found: dict[tuple[MeasuredOn, int, int], AblationEvidence] = {}
        for on in ("probe", "text"):
            heads = list(dict.fromkeys(h for r, hs in wanted.items() if _evidence_input(r) == on for h in hs))
            if heads:
                found.update({(on, *h): e for h, e in self._on_input(on, heads).items()})
        return found

    def _encoded(self, on: MeasuredOn) -> Encoded:
        call = self.call
        if on == "text":
            assert call.text is not None, "text roles are scored, and so checked, only after a text pass"
            return call.text.encoded
        if self.measured.probe is None:  # a check on the probe with no probe role asked: build the seed's probe
            self.measured.probe = build_probe(call.inspector, call.loaded, call.args.probe_length, call.args.seed)
            self.measured.seeds = [call.args.seed]
        return self.measured.probe.encoded

    def _on_input(self, on: MeasuredOn, heads: list[Head]) -> dict[Head, AblationEvidence]:
        args = self.call.args
        random_heads = draw_random_heads(self.call, exclude=heads, count=args.baseline_draws, seed=args.seed)
        effects, metric = self._effects(on, self._encoded(on), [*heads, *random_heads])
        baseline = Baseline(tuple(effects[len(heads) :]))
        return {
            head: _evidence(metric, value, baseline) for head, value in zip(heads, effects[: len(heads)], strict=True)
        }

    def _effects(self, on: MeasuredOn, encoded: Encoded, heads: list[Head]) -> tuple[list[float], EvidenceMetric]:
        """Each head mean-ablated alone (one row each of a batched forward) -> the change in the input's measure.

        A row keeps only what the measure reads (every position's next-token loss, or a model without a next-token
        head its pooled final hidden state): no row's (T, V) logits outlive its batch."""
        readout = PositionLosses(encoded.input_ids) if self.measured.language_model else pooled_hidden
        loaded = self.call.loaded
        with guarded(loaded):
            recorded = recorded_run(loaded, encoded.input_ids, keep_last=False, readout=readout)
        used = {layer for layer, _ in heads}
        means = {  # layer -> (T, H, D): every head's mean output over the positions, at every position
            layer: outputs.mean(0, keepdim=True).expand_as(outputs)
            for layer, outputs in recorded.heads.items()
            if layer in used
        }
        metric, measure = self._measure_for(on, recorded.output[None].cpu())
        patches = [HeadPatch(layer, (head,)) for layer, head in heads]
        (kept,) = self.call.inspector.patched_outputs(
            loaded, encoded, patches, readout=readout, sources=means, keep_last=False
        )
        return measure(kept.cpu()).tolist(), metric  # one copy for every row

    def _measure_for(
        self, on: MeasuredOn, clean: torch.Tensor
    ) -> tuple[EvidenceMetric, Callable[[torch.Tensor], torch.Tensor]]:
        """The metric of an input and a function of what R ablated rows kept ((R, T−1) next-token losses, or (R, C)
        pooled hidden states; on the CPU) giving each row's change from ``clean`` (the same of the clean run)."""
        if not self.measured.language_model:
            return "pooled_cosine_change", lambda kept: cosine_change(clean, kept)
        probe = self.measured.probe
        if on == "probe" and probe is not None:
            where = {"start": probe.start, "repeat_length": probe.repeat_length}
            before = copy_losses_from(clean.double(), **where)[1]
            return "second_copy_loss_change", lambda kept: copy_losses_from(kept.double(), **where)[1] - before
        text_before = clean.double().mean(-1)
        return "next_token_loss_change", lambda kept: kept.double().mean(-1) - text_before


def draw_random_heads(call: _Call, *, exclude: Sequence[Head], count: int, seed: int) -> list[Head]:
    """``count`` distinct heads drawn uniformly (seeded) from the stack's heads other than ``exclude`` (fewer when
    fewer remain: the report states how many were drawn)."""
    excluded, num_heads = set(exclude), call.loaded.facts.num_heads
    pool = [(la, he) for la in range(call.num_layers) for he in range(num_heads) if (la, he) not in excluded]
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed)).tolist()
    return [pool[i] for i in order[:count]]


def _evidence(metric: EvidenceMetric, value: float, baseline: Baseline) -> AblationEvidence:
    return AblationEvidence(
        metric=metric,
        value=value,
        baseline_mean=baseline.mean if baseline.draws else None,
        baseline_spread=baseline.spread if baseline.draws else None,
        baseline_draws=baseline.draws,
        exceeds_baseline=exceeds_baseline(value, baseline, floor=EFFECT_FLOORS[metric]),
    )


def _role_report(
    role: HeadRole,
    measured: _Measured,
    thresholds: dict[HeadRole, float],
    primary: dict[Head, HeadRole | None],
    evidence: Mapping[tuple[MeasuredOn, int, int], AblationEvidence],
    *,
    top_k: int,
    ablate_top: int,
) -> RoleReport:
    """The role's top heads by their mean over its inputs (the first ``ablate_top`` with their ablation check),
    and how many heads take it on the text."""
    threshold, spec = thresholds[role], ROLES[role]
    top = []
    for rank, (layer, head, mean) in enumerate(top_heads(measured.means, role, top_k)):
        found = evidence.get((_evidence_input(role), layer, head)) if rank < ablate_top else None
        checked = found.exceeds_baseline if found is not None and spec.ablation_check is not None else None
        if found is not None and found.metric == "pooled_cosine_change":
            checked = None  # the check is a next-token loss: an encoder cannot run it
        top.append(
            TopHead(
                layer=layer,
                head=head,
                score=mean,
                spread=_at(measured.spreads, layer, role, head),
                score_on_text=_at(measured.scores, layer, role, head) if spec.measured_on == "text" else None,
                qualifies=mean >= threshold,
                primary_role=primary[(layer, head)],
                ablation=found,
                verdict=role_verdict(mean, threshold, checked=checked),
            )
        )
    qualifying = sum(
        int((per_role[role] >= threshold).sum()) for per_role in measured.scores.values() if role in per_role
    )
    return RoleReport(
        role=role,
        formula=spec.formula,
        measured_on=spec.measured_on,
        inputs=measured.inputs.get(role, 1),
        ablation_check=spec.ablation_check,
        threshold=threshold,
        uniform_baseline=_uniform_baseline(measured.layouts.get(spec.measured_on), role),
        heads_with_role=qualifying,
        primary_for=sum(1 for p in primary.values() if p == role),
        top=top,
    )


def _at(scores: Mapping[int, Mapping[_N, torch.Tensor]], layer: int, name: _N, head: int) -> float | None:
    """One head's number for a role or pattern (layer -> name -> (H,)), None where it was not measured."""
    per_name = scores.get(layer, {})
    return float(per_name[name][head]) if name in per_name else None


def _uniform(layout: SequenceLayout) -> torch.Tensor:
    """(1, T, T): a head that spreads each query evenly over the keys it may read."""
    length = layout.length
    allowed = torch.ones(length, length).tril() if layout.causal else torch.ones(length, length)
    return (allowed / allowed.sum(-1, keepdim=True))[None]


def _uniform_baseline(layout: SequenceLayout | None, role: HeadRole) -> float | None:
    """The score of a head that spreads each query evenly over the keys it may read, on the role's own input."""
    if layout is None or not layout.measurable(role):
        return None
    return float(role_scores(_uniform(layout), layout, [role])[role][0])


def _pattern_reports(
    patterns: list[PatternName], text: _TextPass | None, measured: _Measured, *, top_k: int
) -> list[PatternReport]:
    """Each named pattern's top heads by their mean over the texts (the text and the held-out texts)."""
    if text is None or not patterns:
        return []
    runs = [p.patterns.scores() if p.patterns is not None else {} for p in (text, *measured.held_out)]
    on_text = runs[0]
    means, spreads, inputs = _aggregate(runs, patterns, measured.scores)
    reports = []
    for name in patterns:
        top = [
            PatternTop(
                layer=layer,
                head=head,
                score=score,
                spread=_at(spreads, layer, name, head),
                score_on_text=_at(on_text, layer, name, head),
            )
            for layer, head, score in top_heads(means, name, top_k)
        ]
        reports.append(
            PatternReport(
                name=name,
                formula=NAMED_PATTERNS[name].formula,
                inputs=inputs.get(name, 0),
                uniform_baseline=_pattern_uniform(name, text),
                top=top,
            )
        )
    return reports


def _pattern_uniform(name: PatternName, text: _TextPass) -> float | None:
    reader = NAMED_PATTERNS[name].build(text.layout, text.encoded.input_ids[0])
    if reader is None:
        return None
    length = text.layout.length
    pattern = reader.dense(torch.arange(length), length)
    scores = pattern_scores(
        _uniform(text.layout), pattern.clamp(0, 1), causal=text.layout.causal, skip_queries=text.layout.skip_queries
    )
    return float(scores[0])


def _induction_losses(call: _Call, measured: _Measured, *, tested: Sequence[Head]) -> InductionLosses | None:
    """A causal LM's loss on the probe's first and second copy, on the second with the top induction heads
    mean-ablated together, and with as many random heads mean-ablated together (``baseline_draws`` sets drawn from
    the heads not under test on the probe: neither these nor the single-head checks' heads)."""
    inspector, loaded, args = call.inspector, call.loaded, call.args
    probe, clean = measured.probe, measured.probe_output
    if probe is None or clean is None or not measured.language_model:
        return None
    encoded = probe.encoded
    where = {"start": probe.start, "repeat_length": probe.repeat_length}
    first, second = copy_losses(clean, encoded.input_ids, **where)
    chosen = [(layer, head) for layer, head, _ in top_heads(measured.means, "induction", args.top_k)]

    def ablated(heads: list[Head]) -> float:
        effect = inspector.ablate(loaded, encoded.input_ids, encoded.attention_mask, heads, method="mean", clean=clean)
        return copy_losses(effect.ablated, encoded.input_ids, **where)[1]

    together = ablated(chosen)
    draws = []
    for draw in range(args.baseline_draws):
        heads = draw_random_heads(call, exclude=[*chosen, *tested], count=len(chosen), seed=args.seed + 1 + draw)
        if len(heads) == len(chosen):
            draws.append(ablated(heads))
    baseline = Baseline(tuple(value - second for value in draws))
    return InductionLosses(
        first,
        second,
        together,
        [head_label(layer, head) for layer, head in chosen],
        baseline=baseline,
        exceeds=exceeds_baseline(together - second, baseline, floor=EFFECT_FLOORS["second_copy_loss_change"]),
    )


def _induction_check(losses: InductionLosses | None) -> InductionCheck | None:
    if losses is None:
        return None
    baseline = losses.baseline
    return InductionCheck(
        loss_first_copy=losses.first,
        loss_second_copy=losses.second,
        ablated_heads=losses.heads,
        loss_second_copy_ablated=losses.ablated,
        baseline_mean=losses.second + baseline.mean if baseline.draws else None,
        baseline_spread=baseline.spread if baseline.draws else None,
        baseline_draws=baseline.draws,
        exceeds_baseline=losses.exceeds,
    )


def detect_pattern(
    inspector: Inspector,
    model: str | None,
    text: str,
    pattern: UserPattern,
    *,
    layers: list[int] | None = None,
    skip_queries: int | None = None,
) -> dict[int, torch.Tensor]:
    """Python only: every head's score for a user's pattern on ``text``, layer -> (H,), like the built-in roles.

    ``pattern``: a (T, T) query × key tensor of weights in [0, 1] for this text's T tokens, or a function of the
    (T,) token ids returning one (e.g. ``lambda ids: ids[:, None] == ids[None, :]``). Score = the mean over the
    queries ``i ≥ skip_queries`` (default: 2 for a causal model, 0 for an encoder) that may read a key of the
    pattern of ``Σ_j A[i, j] · P[i, j]``; a pattern equal to a role's kernel gives that role's score. Agents
    cannot send code: they name one of the patterns in :data:`agent_tools.analysis.heads.NAMED_PATTERNS`.
    """
    from agent_tools.analysis.heads import user_pattern

    loaded = inspector.model(model)
    stack = inspector.attention_stack(loaded, None)
    checked = inspector.check_layers(loaded, layers, stack, "layer")
    encoded = inspector.encode(loaded, text)
    layout = _text_layout(loaded, encoded, skip_queries)
    reader = user_pattern(pattern, encoded.input_ids[0])
    consumer = PatternScoreConsumer({"pattern": reader}, loaded.facts.num_heads, skip_queries=layout.skip_queries)
    inspector.run(loaded, encoded, [consumer], layers=checked, need_output=False)
    return {layer: per["pattern"] for layer, per in consumer.scores().items() if "pattern" in per}
