"""profile_heads' passes: the text pass as a shareable plan; its finish runs the probe pass and any ablations.

Each pass streams every layer's maps into a :class:`~agent_tools.analysis.heads.RoleScoreConsumer`, which keeps a
few sums per head and drops the maps; ``finish`` turns the sums into scores, classifies every head and ranks the
heads of each role. Every forward goes through the inspector.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agent_tools.analysis.ablation import effect_size
from agent_tools.analysis.heads import (
    DEFAULT_THRESHOLDS,
    HEAD_ROLES,
    PROBE_ROLES,
    ROLE_FORMULAS,
    TEXT_ROLES,
    HeadRole,
    SequenceLayout,
    classify_head,
    copy_losses,
    top_heads,
)
from agent_tools.consumers.roles import RoleScoreConsumer, role_scores
from agent_tools.errors import InvalidInputError
from agent_tools.families import ModelFacts
from agent_tools.inspector import Encoded, Inspector, PassPlan
from agent_tools.loading import LoadedModel
from agent_tools.probes import Probe, build_probe
from agent_tools.prompt_trace import NextCall
from agent_tools.runner import model_output
from agent_tools.runner.patching import HeadPatch
from agent_tools.schemas import head_label, rounded
from agent_tools.stack_input import on_stack
from agent_tools.tools.profile_heads.models import (
    SAMPLE_TEXT,
    AblationEvidence,
    EvidenceMetric,
    HeadProfile,
    HeadProfiles,
    InductionCheck,
    MeasuredOn,
    ProbeInfo,
    ProfileHeadsInput,
    RoleReport,
    TextSource,
    TopHead,
)
from agent_tools.tools.profile_heads.narrative import (
    InductionLosses,
    induction_finding,
    role_finding,
    summary,
    why_unmeasured,
)

Scores = dict[int, dict[HeadRole, torch.Tensor]]  # layer -> role -> (H,) scores


def profile_heads(inspector: Inspector, args: ProfileHeadsInput) -> HeadProfiles:
    """Score every head (or the layers asked) for each role, classify it, and list each role's top heads."""
    return inspector.execute(plan_profile_heads(inspector, args))


def _check_roles(roles: list[HeadRole] | None) -> list[HeadRole]:
    """The roles asked for, in :data:`HEAD_ROLES` order; an empty or repeated list is refused."""
    if roles is None:
        return list(HEAD_ROLES)
    if not roles:
        msg = f"roles is empty; give some of {', '.join(HEAD_ROLES)} or omit it"
        raise InvalidInputError(msg, field="roles")
    if len(set(roles)) != len(roles):
        duplicates = sorted({r for r in roles if roles.count(r) > 1})
        msg = f"roles lists {duplicates} more than once; give each role once"
        raise InvalidInputError(msg, field="roles")
    return [r for r in HEAD_ROLES if r in roles]


@dataclass(frozen=True)
class _TextPass:
    encoded: Encoded
    layout: SequenceLayout
    consumer: RoleScoreConsumer


STACK_REFUSAL = (
    "profile_heads runs its text, its induction probe and its ablations through one sequence; on an "
    "encoder–decoder that is the encoder. Cross-attention reads another sequence, so positional roles (previous "
    "token, induction, local) have no meaning there, and decoder roles are not measured by this tool: look at "
    "the decoder or cross stack with show_attention or diagnose_collapse"
)


def plan_profile_heads(inspector: Inspector, args: ProfileHeadsInput) -> PassPlan[HeadProfiles]:
    """The text pass (role sums over the text, with the model's output for ablation evidence) as a plan; its
    finish runs the probe pass and the ablations."""
    loaded = inspector.model(args.model)
    facts = loaded.facts
    stack = inspector.attention_stack(loaded, args.attention)
    inspector.require_stack(loaded, stack, ("self", "encoder"), STACK_REFUSAL)
    layers = inspector.check_layers(loaded, args.layers, stack, "layer")
    roles = _check_roles(args.roles)
    text_roles = [r for r in roles if r in TEXT_ROLES]
    if not text_roles:
        return PassPlan(loaded, None, [], lambda _output: _profile(inspector, args, loaded, layers, roles, None, None))
    encoded = inspector.encode(loaded, args.text if args.text is not None else SAMPLE_TEXT)
    layout = SequenceLayout.for_text(
        [t.text for t in encoded.tokens],
        [t.special for t in encoded.tokens],
        causal=facts.is_causal,
        skip_queries=args.skip_queries,
        local_window=args.local_window,
    )
    text = _TextPass(encoded, layout, RoleScoreConsumer(layout, text_roles, facts.num_heads))

    def finish(output: object) -> HeadProfiles:
        return _profile(inspector, args, loaded, layers, roles, text, output)

    # The text's output is needed only for ablation evidence on the text roles (asked for with ablate_top).
    return PassPlan(loaded, encoded, [text.consumer], finish, layers=layers, need_output=bool(args.ablate_top))


@dataclass
class _Measured:
    """What the passes produced: per-layer role scores, where each role was measured, each input's clean output."""

    scores: Scores
    measured_on: dict[HeadRole, MeasuredOn] = field(default_factory=dict)
    inputs: dict[MeasuredOn, tuple[Encoded, torch.Tensor]] = field(default_factory=dict)  # input, clean output
    language_model: bool = False
    probe: Probe | None = None
    seeds: list[int] = field(default_factory=list)
    spreads: Scores = field(default_factory=dict)  # layer -> probe role -> (H,) std over the seeds
    layouts: dict[MeasuredOn, SequenceLayout] = field(default_factory=dict)

    def add_scores(self, consumer: RoleScoreConsumer, roles: list[HeadRole], on: MeasuredOn) -> None:
        for layer, per_role in consumer.scores().items():
            self.scores[layer].update(per_role)
        self.measured_on.update({r: on for r in roles})
        self.layouts[on] = consumer.layout

    def add_seed_scores(self, runs: list[dict[int, dict[HeadRole, torch.Tensor]]], roles: list[HeadRole]) -> None:
        """Probe roles: the mean over the seeds' scores, and their standard deviation (population, over seeds)."""
        for layer in runs[0]:
            for role in runs[0][layer]:
                stacked = torch.stack([run[layer][role] for run in runs])  # (seeds, H)
                self.scores[layer][role] = stacked.mean(0)
                self.spreads.setdefault(layer, {})[role] = stacked.std(0, correction=0)
        self.measured_on.update({r: "probe" for r in roles})

    def add_output(self, on: MeasuredOn, encoded: Encoded, output: object) -> None:
        clean, self.language_model = model_output(output)
        self.inputs[on] = (encoded, clean)


def _profile(
    inspector: Inspector,
    args: ProfileHeadsInput,
    loaded: LoadedModel,
    layers: list[int],
    roles: list[HeadRole],
    text: _TextPass | None,
    text_output: object,
) -> HeadProfiles:
    """The plan's finish: the probe pass, every head's profile, each role's top heads, the induction check."""
    facts = loaded.facts
    thresholds = {**DEFAULT_THRESHOLDS, **(args.thresholds.given() if args.thresholds else {})}
    measured = _measure(inspector, args, loaded, layers, roles, text, text_output)
    scored = [r for r in roles if any(r in per_role for per_role in measured.scores.values())]
    heads = _head_profiles(measured, layers, scored, thresholds, facts)
    primary = {(profile.layer, profile.head): profile.primary_role for profile in heads}
    evidence = _Evidence(inspector, loaded, measured)
    counts = {role: _ablated_count(args, role) for role in scored}
    evidence.prefill(
        [(la, he) for r in scored if r in PROBE_ROLES for la, he, _ in top_heads(measured.scores, r, counts[r])]
    )
    role_reports = [
        _role_report(role, measured, thresholds, primary, evidence, top_k=args.top_k, ablate_top=counts[role])
        for role in scored
    ]
    losses = None
    if args.induction_check and "induction" in scored:
        losses = _induction_losses(inspector, loaded, measured, top_k=args.top_k)
    source: TextSource = "user" if args.text is not None else "sample"
    report = HeadProfiles(
        model=loaded.name,
        summary="",
        findings=[role_finding(r) for r in role_reports] + ([induction_finding(losses)] if losses is not None else []),
        layers=layers,
        num_heads=facts.num_heads,
        text_source=source,
        text_tokens=text.encoded.length if text is not None else None,
        probe=_probe_info(measured.probe, measured.seeds),
        thresholds={r: thresholds[r] for r in roles},
        unmeasured={r: why_unmeasured(r, text.layout if text else None) for r in roles if r not in scored},
        roles=role_reports,
        induction_check=_induction_check(losses),
        heads=heads,
    )
    report.attention = facts.stack().name
    said = on_stack(report.attention, summary(report))
    return report.model_copy(update={"summary": said, "next_calls": _next_calls(args, loaded, report)})


def _ablated_count(args: ProfileHeadsInput, role: HeadRole) -> int:
    """How many of the role's top heads get ablation evidence: as asked, or by default every listed head of a
    probe role (cheap: one batched forward over the short probe) and none of a text role."""
    if args.ablate_top is not None:
        return args.ablate_top
    return args.top_k if role in PROBE_ROLES else 0


def _next_calls(args: ProfileHeadsInput, loaded: LoadedModel, report: HeadProfiles) -> list[NextCall]:
    """Ablate the top heads of the first roles on the text: does the model need what they do there?"""
    text = args.text if args.text is not None else SAMPLE_TEXT
    calls = []
    for role in report.roles:
        if role.role in ("induction", "previous_token") and role.top:
            lead = role.top[0]
            calls.append(
                NextCall(
                    tool="ablate_heads",
                    arguments={"model": loaded.name, "text": text, "heads": [head_label(lead.layer, lead.head)]},
                    why=f"L{lead.layer}H{lead.head} is the top {role.role} head; removing it on your text shows "
                    "whether the model needs it there (with its direct logit attribution)",
                )
            )
    return calls


def _measure(
    inspector: Inspector,
    args: ProfileHeadsInput,
    loaded: LoadedModel,
    layers: list[int],
    roles: list[HeadRole],
    text: _TextPass | None,
    text_output: object,
) -> _Measured:
    """Collect the text pass's sums (and output, when kept), then run the probe pass if a probe role is asked."""
    measured = _Measured(scores={layer: {} for layer in layers})
    if text is not None:
        if text_output is not None:
            measured.add_output("text", text.encoded, text_output)
        measured.add_scores(text.consumer, [r for r in roles if r in TEXT_ROLES], "text")
    probe_roles = [r for r in roles if r in PROBE_ROLES]
    if probe_roles:
        _probe_pass(inspector, loaded, args, layers, probe_roles, measured)
    return measured


def _probe_pass(
    inspector: Inspector,
    loaded: LoadedModel,
    args: ProfileHeadsInput,
    layers: list[int],
    roles: list[HeadRole],
    measured: _Measured,
) -> None:
    """Stream ``args.seeds`` seeded probes into the probe roles' sums (scores: their mean, with the spread); the
    first probe's output is kept for the ablations and the induction check."""
    runs = []
    for offset in range(args.seeds):
        probe = build_probe(inspector, loaded, args.probe_length, args.seed + offset)
        layout = SequenceLayout.for_probe(
            probe.encoded.length, start=probe.start, repeat_length=probe.repeat_length, causal=loaded.facts.is_causal
        )
        consumer = RoleScoreConsumer(layout, roles, loaded.facts.num_heads)
        output = inspector.run(loaded, probe.encoded, [consumer], layers=layers, need_output=offset == 0)
        runs.append(consumer.scores())
        measured.seeds.append(args.seed + offset)
        if offset == 0:
            measured.add_output("probe", probe.encoded, output)
            measured.layouts["probe"] = layout
            measured.probe = probe
    measured.add_seed_scores(runs, roles)


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
    scores, spreads = measured.scores, measured.spreads
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
                    scores={r: rounded(s) for r, s in head_scores.items()},
                    primary_role=verdict.primary,
                    confidence=rounded(verdict.confidence),
                    runner_up=verdict.runner_up,
                    runner_up_score=rounded(verdict.runner_up_score) if verdict.runner_up_score is not None else None,
                    score_spread={r: rounded(float(v[head])) for r, v in spreads.get(layer, {}).items() if r in roles},
                )
            )
    return profiles


class _Evidence:
    """Single-head ablations on the input a role was measured on, each run once (a head can lead several roles)."""

    def __init__(self, inspector: Inspector, loaded: LoadedModel, measured: _Measured) -> None:
        self.inspector, self.loaded, self.measured = inspector, loaded, measured
        self.cache: dict[tuple[MeasuredOn, int, int], AblationEvidence] = {}

    def prefill(self, heads: list[tuple[int, int]]) -> None:
        """Single-head zero ablations on the probe, every head in one batched forward (rows of one batch)."""
        wanted = list(dict.fromkeys(h for h in heads if ("probe", *h) not in self.cache))
        probe = self.measured.probe
        if not wanted or probe is None or "probe" not in self.measured.inputs:
            return
        source, clean = self.measured.inputs["probe"]
        patches = [HeadPatch(layer, (head,)) for layer, head in wanted]
        outputs = self.inspector.patched_outputs(self.loaded, source, patches, keep_last=False)  # (R, T, V)
        where = {"start": probe.start, "repeat_length": probe.repeat_length}
        before = copy_losses(clean, source.input_ids, **where)[1] if self.measured.language_model else 0.0
        for row, (layer, head) in enumerate(wanted):
            ablated = outputs[row : row + 1].to(clean.dtype)
            if self.measured.language_model:
                change = copy_losses(ablated, source.input_ids, **where)[1] - before
                found = AblationEvidence(metric="second_copy_loss_change", value=rounded(change))
            else:
                size = effect_size(clean, ablated, language_model=False)
                found = AblationEvidence(metric="pooled_cosine_change", value=rounded(size, 6))
            self.cache[("probe", layer, head)] = found

    def __call__(self, on: MeasuredOn, layer: int, head: int) -> AblationEvidence:
        key = (on, layer, head)
        if key not in self.cache:
            self.cache[key] = self._measure(on, layer, head)
        return self.cache[key]

    def _measure(self, on: MeasuredOn, layer: int, head: int) -> AblationEvidence:
        """Probe roles on an LM: change in second-copy loss; otherwise the mean next-token KL or 1 − cos."""
        source, clean = self.measured.inputs[on]
        effect = self.inspector.ablate(
            self.loaded, source.input_ids, source.attention_mask, [(layer, head)], clean=clean
        )
        probe = self.measured.probe
        if effect.language_model and on == "probe" and probe is not None:
            where = {"start": probe.start, "repeat_length": probe.repeat_length}
            before = copy_losses(clean, source.input_ids, **where)
            after = copy_losses(effect.ablated, source.input_ids, **where)
            return AblationEvidence(metric="second_copy_loss_change", value=rounded(after[1] - before[1]))
        metric: EvidenceMetric = "mean_next_token_kl" if effect.language_model else "pooled_cosine_change"
        size = effect_size(effect.clean, effect.ablated, language_model=effect.language_model)
        return AblationEvidence(metric=metric, value=rounded(size, 6))


def _role_report(
    role: HeadRole,
    measured: _Measured,
    thresholds: dict[HeadRole, float],
    primary: dict[tuple[int, int], HeadRole | None],
    evidence: _Evidence,
    *,
    top_k: int,
    ablate_top: int,
) -> RoleReport:
    """The role's top heads (the first ``ablate_top`` with ablation evidence) and how many heads take it."""
    scores, threshold, spreads = measured.scores, thresholds[role], measured.spreads
    top = [
        TopHead(
            layer=layer,
            head=head,
            score=rounded(score),
            qualifies=score >= threshold,
            primary_role=primary[(layer, head)],
            ablation=evidence(measured.measured_on[role], layer, head) if rank < ablate_top else None,
            spread=rounded(float(spreads[layer][role][head])) if role in spreads.get(layer, {}) else None,
        )
        for rank, (layer, head, score) in enumerate(top_heads(scores, role, top_k))
    ]
    qualifying = sum(int((per_role[role] >= threshold).sum()) for per_role in scores.values() if role in per_role)
    return RoleReport(
        role=role,
        formula=ROLE_FORMULAS[role],
        measured_on=measured.measured_on[role],
        threshold=threshold,
        uniform_baseline=_uniform_baseline(measured, role),
        heads_with_role=qualifying,
        primary_for=sum(1 for p in primary.values() if p == role),
        top=top,
    )


def _uniform_baseline(measured: _Measured, role: HeadRole) -> float | None:
    """The score of a head that spreads each query evenly over the keys it may read, on the role's own input."""
    layout = measured.layouts.get(measured.measured_on[role])
    if layout is None or not layout.measurable(role):
        return None
    length = layout.length
    allowed = torch.ones(length, length).tril() if layout.causal else torch.ones(length, length)
    uniform = allowed / allowed.sum(-1, keepdim=True)  # (T, T)
    return rounded(float(role_scores(uniform[None], layout, [role])[role][0]))


def _induction_losses(
    inspector: Inspector, loaded: LoadedModel, measured: _Measured, *, top_k: int
) -> InductionLosses | None:
    """A causal LM's loss on the probe's first and second copy, and on the second with the top induction heads
    removed together (None: no probe pass, or no next-token head)."""
    probe = measured.probe
    if probe is None or "probe" not in measured.inputs or not measured.language_model:
        return None
    encoded, clean = measured.inputs["probe"]
    where = {"start": probe.start, "repeat_length": probe.repeat_length}
    first, second = copy_losses(clean, encoded.input_ids, **where)
    chosen = [(layer, head) for layer, head, _ in top_heads(measured.scores, "induction", top_k)]
    effect = inspector.ablate(loaded, encoded.input_ids, encoded.attention_mask, chosen, clean=clean)
    ablated = copy_losses(effect.ablated, encoded.input_ids, **where)[1]
    return InductionLosses(first, second, ablated, [head_label(layer, head) for layer, head in chosen])


def _induction_check(losses: InductionLosses | None) -> InductionCheck | None:
    if losses is None:
        return None
    return InductionCheck(
        loss_first_copy=rounded(losses.first),
        loss_second_copy=rounded(losses.second),
        ablated_heads=losses.heads,
        loss_second_copy_ablated=rounded(losses.ablated),
    )
