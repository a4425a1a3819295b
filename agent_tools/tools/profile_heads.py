"""profile_heads: what does each head do? Role scores for every head, a primary role, and the evidence.

Two forward passes with streaming capture, whatever the number of heads: one over the text (text roles) and one
over a probe of random tokens repeated twice (induction, duplicate-token). Each layer's maps are reduced to a
few sums per head as they stream past (:class:`~agent_tools.analysis.heads.RoleScoreConsumer`) and dropped.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, Field

from agent_tools.analysis.heads import (
    DEFAULT_LOCAL_WINDOW,
    DEFAULT_SKIP_CAUSAL,
    DEFAULT_THRESHOLDS,
    HEAD_ROLES,
    PROBE_ROLES,
    ROLE_FORMULAS,
    TEXT_ROLES,
    HeadRole,
    RoleScoreConsumer,
    SequenceLayout,
    classify_head,
    copy_losses,
    top_heads,
)
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Encoded, Inspector, PassPlan, check_indices
from agent_tools.loading import LoadedModel
from agent_tools.schemas import Finding, ModelInput, Report, Token, rounded
from agent_tools.tools.ablate_heads import effect_size, head_label, model_output, run_ablation
from agent_tools.tools.registry import ToolSpec

SAMPLE_TEXT = (
    "The cat sat on the mat because it was tired, and the dog watched it from the door. "
    "When the rain stopped, they both went outside: the cat first, then the dog."
)
_RESERVED_TOKEN = re.compile(r"^(\[.*\]|<.*>)$")
_VOCABULARY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

DEFAULT_PROBE_LENGTH = 32
Threshold = Annotated[float, Field(gt=0, lt=1)]
MeasuredOn = Literal["text", "probe"]
TextSource = Literal["user", "sample"]
EvidenceMetric = Literal["second_copy_loss_change", "mean_next_token_kl", "pooled_cosine_change"]


class ProfileHeadsInput(ModelInput):
    text: str | None = Field(
        default=None,
        description="text for the text roles (previous_token, first_token, self, local, broad, ...); omitted = a "
        "built-in two-sentence sample. Induction and duplicate_token always use the random-token probe.",
    )
    layers: list[int] | None = Field(default=None, description="layers to profile (0-based); omitted = all")
    roles: list[HeadRole] | None = Field(default=None, description="roles to score; omitted = all")
    seed: int = Field(default=0, ge=0, description="seed of the probe's random tokens (same seed, same probe)")
    probe_length: int | None = Field(
        default=None,
        ge=4,
        le=512,
        description=f"N: random tokens per copy; the probe is [BOS] + N tokens + the same N; omitted = "
        f"{DEFAULT_PROBE_LENGTH}, or as many as the model's positions allow",
    )
    top_k: int = Field(default=3, ge=1, le=20, description="top heads listed per role")
    thresholds: dict[HeadRole, Threshold] | None = Field(
        default=None,
        description="per-role score a head needs to take the role; defaults: "
        + ", ".join(f"{r} {t}" for r, t in DEFAULT_THRESHOLDS.items()),
    )
    skip_queries: int | None = Field(
        default=None,
        ge=0,
        description=f"queries before this position are not scored; omitted = {DEFAULT_SKIP_CAUSAL} for causal models "
        "(early rows see only 1–2 keys), 0 for encoders",
    )
    local_window: int = Field(
        default=DEFAULT_LOCAL_WINDOW, ge=2, le=64, description="local = keys 2..local_window positions away"
    )
    induction_check: bool = Field(
        default=True,
        description="causal LMs: loss on the probe's second copy vs the first, and with the top induction heads "
        "ablated",
    )
    ablate_top: int = Field(
        default=0,
        ge=0,
        le=5,
        description="ablate each role's top N heads one at a time on that role's input and attach the effect "
        "(one extra forward each); 0 = off",
    )


class HeadProfile(BaseModel):
    layer: int
    head: int
    kv_head: int
    scores: dict[HeadRole, float] = Field(description="every measurable role's score in [0, 1]")
    primary_role: HeadRole | None = Field(
        description="the qualifying role furthest past its threshold, specific roles before the fallbacks first_token "
        "and broad (what a head does when its pattern is absent); None = no role reaches its threshold"
    )
    confidence: float = Field(description="(score − threshold) / (1 − threshold) of the primary role, 0..1")
    runner_up: HeadRole | None = None
    runner_up_score: float | None = None


class AblationEvidence(BaseModel):
    metric: EvidenceMetric = Field(
        description="probe roles on an LM: change in loss on the second copy (nats); text roles on an LM: KL of the "
        "next-token distribution averaged over positions; encoders: 1 − cos of the mean-pooled embedding"
    )
    value: float


class TopHead(BaseModel):
    layer: int
    head: int
    score: float
    qualifies: bool = Field(description="score ≥ the role's threshold")
    primary_role: HeadRole | None
    ablation: AblationEvidence | None = None


class RoleReport(BaseModel):
    role: HeadRole
    formula: str
    measured_on: MeasuredOn
    threshold: float
    heads_with_role: int = Field(description="heads whose score reaches the threshold")
    primary_for: int = Field(description="heads whose primary role this is")
    top: list[TopHead]


class ProbeInfo(BaseModel):
    seed: int
    repeat_length: int = Field(description="N random tokens per copy")
    length: int = Field(description="probe tokens in all (prefix + 2N + suffix)")
    first_copy_start: int
    preview: list[str] = Field(description="the probe's first tokens")


class InductionCheck(BaseModel):
    loss_first_copy: float = Field(description="mean next-token loss on the first copy (random tokens), nats")
    loss_second_copy: float = Field(description="the same on the second copy; far lower = the model copies")
    ablated_heads: list[str] = Field(description="top induction heads removed together (zero ablation)")
    loss_second_copy_ablated: float | None = Field(default=None, description="second-copy loss with them removed")


class HeadProfiles(Report):
    layers: list[int]
    num_heads: int
    text_source: TextSource
    text_tokens: int | None
    probe: ProbeInfo | None
    thresholds: dict[HeadRole, float]
    unmeasured: dict[HeadRole, str] = Field(default_factory=dict, description="roles that could not be scored, why")
    roles: list[RoleReport]
    induction_check: InductionCheck | None = None
    heads: list[HeadProfile]


# --- the probe ------------------------------------------------------------------------------------------------


def probe_vocabulary(loaded: LoadedModel) -> torch.Tensor:
    """Token ids a probe may draw: not special, not a reserved marker like [unused0] or <filename>."""
    tokenizer = loaded.tokenizer
    cached = _VOCABULARY.get(tokenizer)
    if cached is not None:
        return cached
    embeddings = loaded.model.get_input_embeddings()  # type: ignore[operator]
    size = min(len(tokenizer), int(embeddings.num_embeddings))  # type: ignore[arg-type]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))  # type: ignore[attr-defined]
    ids = torch.tensor(
        [i for i, piece in enumerate(pieces) if i not in special and piece and not _RESERVED_TOKEN.match(piece)]
    )
    _VOCABULARY[tokenizer] = ids
    return ids


def special_frame(loaded: LoadedModel) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts around a text (e.g. [CLS] … [SEP]); a causal model with none gets BOS."""
    tokenizer = loaded.tokenizer
    framed = tokenizer("a", add_special_tokens=True)["input_ids"]  # type: ignore[operator]
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    prefix: list[int] = []
    suffix: list[int] = []
    for start in range(len(framed) - len(bare) + 1):
        if framed[start : start + len(bare)] == bare:
            prefix, suffix = list(framed[:start]), list(framed[start + len(bare) :])
            break
    if not prefix and loaded.facts.is_causal:
        bos = getattr(tokenizer, "bos_token_id", None)
        bos = bos if bos is not None else loaded.facts.bos_token_id
        if bos is not None:
            prefix = [int(bos)]
    return prefix, suffix


def build_probe(
    inspector: Inspector, loaded: LoadedModel, repeat_length: int | None, seed: int
) -> tuple[Encoded, int, int]:
    """[prefix] r₁…r_N r₁…r_N [suffix] with N distinct random tokens drawn by ``seed``; returns (probe, start, N).

    ``repeat_length=None`` takes the default N, shortened to what the model's positions and vocabulary allow.
    """
    vocabulary = probe_vocabulary(loaded)
    prefix, suffix = special_frame(loaded)
    limit = inspector.limit_for(loaded)
    most = (limit - len(prefix) - len(suffix)) // 2
    if repeat_length is None:
        repeat_length = min(DEFAULT_PROBE_LENGTH, most, len(vocabulary))
        if repeat_length < 4:
            msg = f"{loaded.name!r} allows only {limit} tokens: too few for a probe of two copies of 4 tokens"
            raise ResourceLimitError(msg, field="probe_length")
    if repeat_length > len(vocabulary):
        msg = f"probe_length {repeat_length} exceeds the {len(vocabulary)} usable tokens of {loaded.name!r}"
        raise InvalidInputError(msg, field="probe_length")
    if repeat_length > most:
        msg = f"probe_length {repeat_length} makes a probe longer than {limit} tokens; use 4..{most}"
        raise ResourceLimitError(msg, field="probe_length")
    generator = torch.Generator().manual_seed(seed)
    chosen = vocabulary[torch.randperm(len(vocabulary), generator=generator)[:repeat_length]].tolist()
    ids = [*prefix, *chosen, *chosen, *suffix]
    special_ids = set(getattr(loaded.tokenizer, "all_special_ids", []) or [])
    tokens = [
        Token(position=i, text=loaded.tokenizer.decode([t]), token_id=t, special=t in special_ids)  # type: ignore[attr-defined]
        for i, t in enumerate(ids)
    ]
    input_ids = torch.tensor([ids])
    probe = Encoded(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        tokens=tokens,
        offsets=[(0, 0)] * len(ids),
        text="",
    )
    return probe, len(prefix), repeat_length


# --- the tool -------------------------------------------------------------------------------------------------


def _check_roles(roles: list[HeadRole] | None) -> list[HeadRole]:
    if roles is None:
        return list(HEAD_ROLES)
    if not roles:
        raise InvalidInputError(f"roles is empty; give some of {', '.join(HEAD_ROLES)} or omit it", field="roles")
    if len(set(roles)) != len(roles):
        duplicates = sorted({r for r in roles if roles.count(r) > 1})
        raise InvalidInputError(f"roles lists {duplicates} more than once; give each role once", field="roles")
    return [r for r in HEAD_ROLES if r in roles]


def _why_unmeasured(role: HeadRole, layout: SequenceLayout | None) -> str:
    if role == "next_token":
        return "a causal model's query cannot see the next token"
    if role == "special_token":
        return "the text has no special token after the first position"
    if role == "punctuation":
        return "the text has no punctuation token after the first position"
    return "the sequence is too short" if layout is not None else "not scored"


def profile_heads(inspector: Inspector, args: ProfileHeadsInput) -> HeadProfiles:
    """Score every head (or the layers asked) for each role, classify it, and list each role's top heads."""
    return inspector.execute(plan_profile_heads(inspector, args))


@dataclass(frozen=True)
class _TextPass:
    encoded: Encoded
    layout: SequenceLayout
    consumer: RoleScoreConsumer


def plan_profile_heads(inspector: Inspector, args: ProfileHeadsInput) -> PassPlan[HeadProfiles]:
    """The text pass (role sums over the text, with the model's output for ablation evidence) as a plan; its
    finish runs the probe pass and the ablations."""
    loaded = inspector.model(args.model)
    facts = loaded.facts
    layers = check_indices(args.layers, facts.num_layers, "layer")
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

    # The text's output is needed only for ablation evidence on the text roles.
    return PassPlan(loaded, encoded, [text.consumer], finish, layers=layers, need_output=args.ablate_top > 0)


def _profile(
    inspector: Inspector,
    args: ProfileHeadsInput,
    loaded: LoadedModel,
    layers: list[int],
    roles: list[HeadRole],
    text: _TextPass | None,
    text_output: object,
) -> HeadProfiles:
    facts = loaded.facts
    thresholds = {**DEFAULT_THRESHOLDS, **(args.thresholds or {})}
    text_roles = [r for r in roles if r in TEXT_ROLES]
    probe_roles = [r for r in roles if r in PROBE_ROLES]

    scores: dict[int, dict[HeadRole, torch.Tensor]] = {layer: {} for layer in layers}
    measured_on: dict[HeadRole, MeasuredOn] = {}
    inputs: dict[MeasuredOn, tuple[Encoded, torch.Tensor]] = {}  # the input and its clean output
    language_model = False
    text_layout = encoded = None
    if text is not None:
        encoded, text_layout, consumer = text.encoded, text.layout, text.consumer
        if text_output is not None:
            clean, language_model = model_output(text_output)
            inputs["text"] = (encoded, clean)
        for layer, per_role in consumer.scores().items():
            scores[layer].update(per_role)
        measured_on.update({r: "text" for r in text_roles})

    probe_info = None
    probe_start = probe_length = 0
    if probe_roles:
        probe, probe_start, probe_length = build_probe(inspector, loaded, args.probe_length, args.seed)
        probe_layout = SequenceLayout.for_probe(
            probe.length, start=probe_start, repeat_length=probe_length, causal=facts.is_causal
        )
        consumer = RoleScoreConsumer(probe_layout, probe_roles, facts.num_heads)
        output = inspector.run(loaded, probe, [consumer], layers=layers)
        clean, language_model = model_output(output)
        inputs["probe"] = (probe, clean)
        for layer, per_role in consumer.scores().items():
            scores[layer].update(per_role)
        measured_on.update({r: "probe" for r in probe_roles})
        probe_info = ProbeInfo(
            seed=args.seed,
            repeat_length=probe_length,
            length=probe.length,
            first_copy_start=probe_start,
            preview=[t.text for t in probe.tokens[: probe_start + 8]],
        )

    scored_roles = [r for r in roles if any(r in per_role for per_role in scores.values())]
    unmeasured = {r: _why_unmeasured(r, text_layout) for r in roles if r not in scored_roles}

    # --- per head: all scores, primary role, runner-up -------------------------------------------------------
    heads: list[HeadProfile] = []
    primary: dict[tuple[int, int], HeadRole | None] = {}
    for layer in layers:
        for head in range(facts.num_heads):
            head_scores = {r: float(scores[layer][r][head]) for r in scored_roles if r in scores[layer]}
            verdict = classify_head(head_scores, thresholds)
            primary[(layer, head)] = verdict.primary
            heads.append(
                HeadProfile(
                    layer=layer,
                    head=head,
                    kv_head=facts.kv_head_of(head),
                    scores={r: rounded(s) for r, s in head_scores.items()},
                    primary_role=verdict.primary,
                    confidence=rounded(verdict.confidence),
                    runner_up=verdict.runner_up,
                    runner_up_score=rounded(verdict.runner_up_score) if verdict.runner_up_score is not None else None,
                )
            )

    # --- per role: top heads, with ablation evidence when asked ----------------------------------------------
    evidence_cache: dict[tuple[MeasuredOn, int, int], AblationEvidence] = {}

    def evidence(on: MeasuredOn, layer: int, head: int) -> AblationEvidence:
        key = (on, layer, head)
        if key not in evidence_cache:
            source, clean = inputs[on]
            effect = run_ablation(loaded, source.input_ids, source.attention_mask, [(layer, head)], clean=clean)
            if effect.language_model and on == "probe":
                before = copy_losses(clean, source.input_ids, start=probe_start, repeat_length=probe_length)
                after = copy_losses(effect.ablated, source.input_ids, start=probe_start, repeat_length=probe_length)
                found = AblationEvidence(metric="second_copy_loss_change", value=rounded(after[1] - before[1]))
            else:
                metric: EvidenceMetric = "mean_next_token_kl" if effect.language_model else "pooled_cosine_change"
                found = AblationEvidence(metric=metric, value=rounded(effect_size(effect), 6))
            evidence_cache[key] = found
        return evidence_cache[key]

    role_reports: list[RoleReport] = []
    findings: list[Finding] = []
    for role in scored_roles:
        best = top_heads(scores, role, args.top_k)
        top = [
            TopHead(
                layer=layer,
                head=head,
                score=rounded(score),
                qualifies=score >= thresholds[role],
                primary_role=primary[(layer, head)],
                ablation=evidence(measured_on[role], layer, head) if rank < args.ablate_top else None,
            )
            for rank, (layer, head, score) in enumerate(best)
        ]
        qualifying = sum(
            int((scores[layer][role] >= thresholds[role]).sum()) for layer in layers if role in scores[layer]
        )
        role_reports.append(
            RoleReport(
                role=role,
                formula=ROLE_FORMULAS[role],
                measured_on=measured_on[role],
                threshold=thresholds[role],
                heads_with_role=qualifying,
                primary_for=sum(1 for p in primary.values() if p == role),
                top=top,
            )
        )
        lead = top[0]
        proof = (
            f"; ablating it gives {lead.ablation.metric} {lead.ablation.value:+.4g}"
            if lead.ablation is not None
            else ""
        )
        findings.append(
            Finding(
                kind=role,
                layer=lead.layer,
                head=lead.head,
                value=lead.score,
                detail=f"L{lead.layer}H{lead.head} is the top {role} head: {ROLE_FORMULAS[role]} = {lead.score:.3f} "
                f"on the {measured_on[role]} ({qualifying} heads reach {thresholds[role]}){proof}",
            )
        )

    # --- behavioural induction check ---------------------------------------------------------------------------
    check = None
    if args.induction_check and "probe" in inputs and "induction" in scored_roles:
        probe, clean = inputs["probe"]
        if language_model:
            first, second = copy_losses(clean, probe.input_ids, start=probe_start, repeat_length=probe_length)
            chosen = [(layer, head) for layer, head, _ in top_heads(scores, "induction", args.top_k)]
            effect = run_ablation(loaded, probe.input_ids, probe.attention_mask, chosen, clean=clean)
            ablated = copy_losses(effect.ablated, probe.input_ids, start=probe_start, repeat_length=probe_length)[1]
            check = InductionCheck(
                loss_first_copy=rounded(first),
                loss_second_copy=rounded(second),
                ablated_heads=[head_label(layer, head) for layer, head in chosen],
                loss_second_copy_ablated=rounded(ablated),
            )
            findings.append(
                Finding(
                    kind="induction_behaviour",
                    value=rounded(first - second),
                    detail=f"next-token loss falls from {first:.3f} nats on the probe's first copy to {second:.3f} on "
                    f"the second; removing heads {', '.join(check.ablated_heads)} raises it to {ablated:.3f}",
                )
            )

    text_tokens = encoded.length if encoded is not None else None
    source: TextSource = "user" if args.text is not None else "sample"
    counts: dict[str, int] = {}
    for p in primary.values():
        counts[p or "none"] = counts.get(p or "none", 0) + 1
    where = []
    if text_tokens is not None:
        where.append(f"{'the text' if source == 'user' else 'the built-in sample text'} ({text_tokens} tokens)")
    if probe_info is not None:
        where.append(f"a seed-{args.seed} probe of 2×{probe_length} random tokens")
    leaders = "; ".join(
        f"{r.role} L{r.top[0].layer}H{r.top[0].head} {r.top[0].score:.3f}"
        + (f" (ablated: {r.top[0].ablation.metric} {r.top[0].ablation.value:+.4g})" if r.top[0].ablation else "")
        for r in role_reports
    )
    census = ", ".join(f"{n} {role}" for role, n in sorted(counts.items(), key=lambda item: -item[1]))
    summary = (
        f"Profiled {len(heads)} heads ({len(layers)} layers × {facts.num_heads}) of {loaded.name} on "
        f"{' and '.join(where)}. Top head per role: {leaders}. Primary roles: {census}."
    )
    if check is not None:
        summary += (
            f" Induction check: loss {check.loss_first_copy:.3f} → {check.loss_second_copy:.3f} nats from the first "
            f"to the second copy; {check.loss_second_copy_ablated:.3f} with {', '.join(check.ablated_heads)} removed."
        )
    if unmeasured:
        summary += " Not measurable here: " + "; ".join(f"{r} ({why})" for r, why in unmeasured.items()) + "."
    return HeadProfiles(
        model=loaded.name,
        summary=summary,
        findings=findings,
        layers=layers,
        num_heads=facts.num_heads,
        text_source=source,
        text_tokens=text_tokens,
        probe=probe_info,
        thresholds={r: thresholds[r] for r in roles},
        unmeasured=unmeasured,
        roles=role_reports,
        induction_check=check,
        heads=heads,
    )


SPEC = ToolSpec(
    name="profile_heads",
    description=(
        "Profile what every attention head does: role scores (previous_token, induction, duplicate_token, "
        "first_token/sink, self, local, broad, next_token, special_token, punctuation), each a documented attention "
        "share in [0, 1], a primary role with a confidence and runner-up per head, the top heads per role, and a "
        "behavioural induction check (loss on a repeated random sequence). Text roles use your text (or a sample); "
        "induction and duplicate-token use a seeded random probe. Optionally ablates top heads as evidence."
    ),
    input_model=ProfileHeadsInput,
    output_model=HeadProfiles,
    run=profile_heads,
    plan=plan_profile_heads,
    example={"text": "The cat sat on the mat because it was tired.", "layers": [0, 1, 2]},
)
