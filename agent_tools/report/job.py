"""The ``analyze`` job's orchestration: run describe, collapse, roles, scaling, projections, the reconstruction
and the training experiment on one text, and collect everything the terminal, JSON, PNG, HTML and notebook
outputs need (the CLI's ``analyze`` command, in :mod:`agent_tools.cli.analyze`, only parses options and prints).

Each step calls a tool through its declaration (the same path every surface uses). Steps whose tools declare
their pass as a plan share passes: diagnose_collapse and profile_heads' text roles stream from the capture that
keeps every head's map (quantised) for the grids and the interactive views; explain_scaling, inspect_projections
and reconstruct_attention, on the most collapsed head, from a second pass that stops at its layer. Two small
extras feed the story's pictures (:mod:`agent_tools.report.views`): the top induction head on the probe it was
measured on (one pass over ~65 tokens), and every head's collapse row (read from the shared pass's consumer).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, Field

from agent_tools.analysis.collapse import rank_heads
from agent_tools.consumers.collapse import CollapseConsumer
from agent_tools.consumers.grid import QuantisedMaps
from agent_tools.errors import AttentionToolError
from agent_tools.inspector import Encoded, Inspector, PassPlan, check_indices
from agent_tools.loading import LoadedModel
from agent_tools.report.long_context import LONG_CONTEXT_TOKENS, U_CURVE_TOKENS, long_context_steps
from agent_tools.report.views import (
    NeuronData,
    ProbeView,
    StageViews,
    neuron_data,
    probe_view,
    stage_views,
)
from agent_tools.runner.replay import RecordedCalls
from agent_tools.schemas import Report, Rounded, Token
from agent_tools.tools import TOOLS
from agent_tools.tools.diagnose_collapse.models import HeadCollapseRow
from agent_tools.tools.diagnose_collapse.plan import head_row
from agent_tools.tools.reconstruct_attention import Reconstruction, plan_reconstruction

if TYPE_CHECKING:
    from agent_tools.report.notebook_view import InteractivePage, StepView

DEFAULT_TEXT = (
    "When Mary and John went to the store, John gave a drink to Mary. "
    "The store was closed on Sunday, so they walked back home along the river and talked about the weather."
)
MAX_INTERACTIVE_TOKENS = 384
# The report's training experiment: the tool's defaults (four runs of 300 SGD steps, about 1.5 s on one core).
EXPERIMENT_ARGUMENTS: dict[str, Any] = {"detail": "full"}  # every logged point, for the curves

Progress = Callable[[str], None]
R = TypeVar("R", bound=Report)


class AnalysisReport(BaseModel):
    """Every report of one ``analyze`` run, as plain JSON."""

    model: str
    dtype: str = Field(description="the precision the model ran in")
    device: str = Field(description="where it ran (a sharded model's input device)")
    text: str
    tokens: list[Token]
    reports: dict[str, dict[str, Any]] = Field(description="tool name -> that tool's report")
    skipped: dict[str, str] = Field(default_factory=dict, description="steps that did not run, and why")
    head_entropy: list[list[Rounded]] = Field(description="layer × head mean attention entropy, nats")
    head_normalised_entropy: list[list[Rounded]]
    head_sink_share: list[list[Rounded]] = Field(description="layer × head mean weight on position 0")
    head_max_weight: list[list[Rounded]]
    story: list[dict[str, Any]] = Field(
        default_factory=list, description="the story's steps in order: key, title, question, sentences, pictures"
    )
    timings: dict[str, float] = Field(description="seconds per step")


ANALYSIS_VIEWS: dict[str, Callable[..., Any]] = {}
"""How an :class:`AnalysisResult` draws itself in a notebook ("html", "markdown", "step", "page"), registered by
:mod:`agent_tools.report.notebook_view` when it is imported, so the orchestration imports none of its renderers."""


def _view(name: str) -> Callable[..., Any]:
    found = ANALYSIS_VIEWS.get(name)
    if found is None:
        msg = f"no notebook view {name!r} registered: import agent_tools.report.notebook_view (Explainer does)"
        raise RuntimeError(msg)
    return found


@dataclass
class AnalysisResult:
    """One ``analyze`` run in memory: the reports as models and the maps as tensors, for every output."""

    model: str
    dtype: str
    device: str
    text: str
    tokens: list[Token]
    reports: dict[str, Report]
    maps: QuantisedMaps
    timings: dict[str, float]
    skipped: dict[str, str] = field(default_factory=dict)
    collapse_rows: list[HeadCollapseRow] = field(default_factory=list)  # every head, most collapsed first
    stages: StageViews | None = None  # the focus head's reconstruction, for the story's pictures
    neuron: NeuronData | None = None  # the focus head's q and k, for the page's neuron view
    probe: ProbeView | None = None  # the top induction head on its probe
    pictures: dict[str, Any] = field(default_factory=dict, repr=False)  # drawn once: name -> Picture
    written_to: Path | None = None  # the folder the files went to (the terminal names the pictures there)

    def report(self, name: str, kind: type[R]) -> R | None:
        """The report of step ``name`` when it ran and is a ``kind`` (None otherwise)."""
        found = self.reports.get(name)
        return found if isinstance(found, kind) else None

    def _repr_html_(self) -> str:
        """Jupyter: the story with its pictures, the findings and the glossary (:mod:`.notebook_view`)."""
        return _view("html")(self)

    def _repr_markdown_(self) -> str:
        """Text front-ends: the story's sentences, the findings and the glossary."""
        return _view("markdown")(self)

    def step(self, key: str) -> StepView:
        """One step of the story for a notebook cell (raw, scale, stages, no_projections, collapse, roles,
        training): its sentences and pictures."""
        return _view("step")(self, key)

    def page(self, *, height: int = 900) -> InteractivePage:
        """The interactive page (model view, attention view, neuron view) for a notebook cell (an iframe)."""
        return _view("page")(self, height=height)

    def to_report(self) -> AnalysisReport:
        from agent_tools.report.story import build_story  # the story reads this result: imported on use

        return AnalysisReport(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            text=self.text,
            tokens=self.tokens,
            reports={name: r.model_dump(mode="json") for name, r in self.reports.items()},
            skipped=self.skipped,
            head_entropy=self.maps.entropy.tolist(),
            head_normalised_entropy=self.maps.normalised_entropy.tolist(),
            head_sink_share=self.maps.first_token_share.tolist(),
            head_max_weight=self.maps.max_weight.tolist(),
            story=[step.as_json() for step in build_story(self)],
            timings={k: round(v, 3) for k, v in self.timings.items()},
        )


def most_collapsed_head(maps: QuantisedMaps) -> tuple[int, int]:
    """(layer, head) of the lowest mean normalised entropy: the head the focus tools and the neuron view examine."""
    flat = int(maps.normalised_entropy.flatten().argmin())
    return divmod(flat, maps.normalised_entropy.shape[1])


def _plan_steps(
    text: str, model: str | None, *, layers: list[int] | None = None, focus: tuple[int, int] | None = None
) -> list[tuple[str, dict]]:
    """The tools' calls on ``text``: over every head (``focus`` None: they need nothing from the capture, so they
    may share its pass), or on the most collapsed head, chosen from the capture. The reconstruction applies the
    mask at every stage, so each stage's picture of the first tokens shows exactly what those queries may read."""
    with_model: dict[str, Any] = {"detail": "full"} | ({"model": model} if model else {})
    base = with_model | {"text": text}
    if focus is None:
        every = base | ({"layers": layers} if layers else {})
        steps = [("describe_model", with_model), ("diagnose_collapse", every), ("profile_heads", every)]
    else:
        layer, head = focus
        steps = [
            ("explain_scaling", base | {"layer": layer}),
            ("inspect_projections", base | {"layer": layer, "head": head}),
            ("reconstruct_attention", base | {"layer": layer, "head": head, "mask_every_stage": True}),
        ]
    return steps


@dataclass
class StepOutcomes:
    """What the steps have produced so far: their reports, why others were skipped, and seconds per step."""

    say: Progress
    reports: dict[str, Report] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    reconstruction: Reconstruction | None = None  # kept by the reconstruction's plan for the pictures

    def attempt(self, name: str, call: Callable[[], Report]) -> None:
        """Run one step, timed; an expected failure of its input skips it with the error's message."""
        self.say(f"running {name}")
        start = time.perf_counter()
        try:
            self.reports[name] = call()
        except AttentionToolError as exc:
            self.skipped[name] = exc.message
        self.timings[name] = time.perf_counter() - start


def _reconstruction_plan(inspector: Inspector, arguments: dict, outcomes: StepOutcomes) -> PassPlan[Report]:
    """reconstruct_attention's plan, finishing with its checked report and keeping the stage tensors."""
    spec = TOOLS["reconstruct_attention"]

    def keep(rebuilt: Reconstruction) -> Report:
        outcomes.reconstruction = rebuilt
        return spec.check(rebuilt.report, inspector)

    return plan_reconstruction(inspector, spec.parse(arguments)).then(keep)


def _prepare_plans(
    inspector: Inspector, steps: list[tuple[str, dict]], outcomes: StepOutcomes
) -> dict[str, PassPlan[Report]]:
    """The plans of the steps whose tools declare one; a step whose arguments are refused is skipped here."""
    plans: dict[str, PassPlan[Report]] = {}
    for name, arguments in steps:
        spec = TOOLS[name]
        if spec.plan is None:
            continue
        try:
            if name == "reconstruct_attention":
                plan: PassPlan[Report] | None = _reconstruction_plan(inspector, arguments, outcomes)
            else:
                plan = spec.prepare(inspector, arguments)
        except AttentionToolError as exc:
            outcomes.skipped[name] = exc.message
            continue
        if plan is not None:
            plans[name] = plan
    return plans


def _run_shared_pass(
    inspector: Inspector,
    plans: dict[str, PassPlan[Report]],
    outcomes: StepOutcomes,
    *,
    pass_name: str,
    lead: PassPlan[Any] | None,
    replay: RecordedCalls | None = None,
) -> set[str]:
    """Stream the plans that share a pass (with ``lead`` when given) from one forward pass, timed as
    ``pass_name``, and finish each; returns the names that ran (none when there is nothing to share).

    With ``replay`` (the attention calls an earlier pass over the same tokens kept), plans of one layer run from
    that layer's recorded call instead of a forward pass through every layer before it."""
    first = lead if lead is not None else next(iter(plans.values()), None)
    shared = {name: plan for name, plan in plans.items() if first is not None and first.shares_pass_with(plan)}
    if lead is None and len(shared) <= 1:
        return set()
    start = time.perf_counter()
    together = ([lead] if lead is not None else []) + list(shared.values())
    try:
        replayed = replay is not None and inspector.replay_together(together, replay)
        output = None if replayed else inspector.run_together(together)
    except AttentionToolError:
        if lead is not None:  # the lead's consumers hold a partial pass: nothing to fall back on
            raise
        output, shared = None, {}  # one step's consumer refused this model: each step runs alone instead
    outcomes.timings[pass_name] = time.perf_counter() - start
    for name, plan in shared.items():
        outcomes.attempt(name, partial(plan.finish, output if plan.need_output else None))
    return set(shared)  # the pass's language-model logits (T × vocabulary floats) go before the next step


def _run_steps(
    inspector: Inspector,
    steps: list[tuple[str, dict]],
    outcomes: StepOutcomes,
    *,
    pass_name: str,
    lead: PassPlan[Any] | None = None,
    replay: RecordedCalls | None = None,
) -> dict[str, PassPlan[Report]]:
    """Run ``steps``; those whose tools declare a plan sharing one pass (with ``lead`` when given) stream from a
    single forward pass, timed as ``pass_name``. The rest, or all if the shared pass fails, run one by one.
    Returns the plans that shared the pass (their consumers hold what the pass gave them)."""
    steps = _available(steps, outcomes)
    plans = _prepare_plans(inspector, steps, outcomes)
    done = _run_shared_pass(inspector, plans, outcomes, pass_name=pass_name, lead=lead, replay=replay)
    for name, arguments in steps:
        if name not in done and name not in outcomes.skipped:
            outcomes.attempt(name, partial(TOOLS[name], inspector, arguments))
    return {name: plans[name] for name in done}


def _available(steps: list[tuple[str, dict]], outcomes: StepOutcomes) -> list[tuple[str, dict]]:
    """The steps whose tool this build has; the others are skipped, saying so."""
    for name, _arguments in steps:
        if name not in TOOLS:
            outcomes.skipped[name] = "tool not available in this build"
    return [(name, arguments) for name, arguments in steps if name in TOOLS]


def _head_maps(inspector: Inspector, loaded: LoadedModel, encoded: Encoded) -> QuantisedMaps:
    """The consumer keeping every head's statistics, and every map (1 byte an entry) only where the interactive
    view can use it: texts up to ``MAX_INTERACTIVE_TOKENS`` tokens, within the memory budget."""
    facts = loaded.facts
    keep_maps = encoded.length <= MAX_INTERACTIVE_TOKENS
    if keep_maps:  # one byte per weight, every layer and head
        inspector.check_budget(facts.num_layers * facts.num_heads * encoded.length**2, "the interactive report's maps")
    return QuantisedMaps(facts.num_layers, facts.num_heads, encoded.length, keep_maps=keep_maps)


def _collapse_rows(plans: dict[str, PassPlan[Report]], loaded: LoadedModel, encoded: Encoded) -> list[HeadCollapseRow]:
    """Every examined head's collapse row, most collapsed first, from the shared pass's consumer (the report lists
    only the top few; the story names every head that writes substantially, wherever it ranks). Empty when collapse ran
    alone."""
    plan = plans.get("diagnose_collapse")
    consumers = [c for c in (plan.consumers if plan is not None else []) if isinstance(c, CollapseConsumer)]
    if not consumers:
        return []
    stats = rank_heads(consumers[0].results())
    return [head_row(s, encoded.tokens, loaded.facts.kv_head_of(s.head)) for s in stats]


def _induction_probe(inspector: Inspector, loaded: LoadedModel, outcomes: StepOutcomes) -> ProbeView | None:
    """The top induction head's map on the probe profile_heads measured it on (None without one)."""
    profile = outcomes.reports.get("profile_heads")
    probe = getattr(profile, "probe", None)
    role = next((r for r in getattr(profile, "roles", []) if r.role == "induction" and r.top), None)
    if probe is None or role is None:
        return None
    top = role.top[0]
    start = time.perf_counter()
    outcomes.say("drawing the induction head on its probe")
    view = probe_view(inspector, loaded, top, role.threshold, seed=probe.seed, repeat_length=probe.repeat_length)
    outcomes.timings["induction_probe"] = time.perf_counter() - start
    return view


def _long_context(
    inspector: Inspector,
    loaded: LoadedModel,
    text: str,
    model: str | None,
    tokens: int,
    outcomes: StepOutcomes,
    asked: bool | None,
    threshold: int,
) -> None:
    """The long-context steps: by length when ``asked`` is None, always when True, never when False. The U-curve's
    prompt is sized with the model's own tokenizer, within its limit."""
    if asked is False:
        outcomes.skipped["long_context"] = "not asked for (--no-long-context)"
        return
    tokenizer = loaded.tokenizer
    count = lambda prompt: len(tokenizer(prompt)["input_ids"])  # noqa: E731
    limit = min(U_CURVE_TOKENS, inspector.limit_for(loaded))
    steps = long_context_steps(text, model, tokens, threshold=0 if asked else threshold, count=count, limit=limit)
    if isinstance(steps, str):
        outcomes.skipped["long_context"] = steps
        return
    outcomes.say("measuring long-context heads")
    for name, arguments in _available(steps, outcomes):
        outcomes.attempt(name, partial(TOOLS[name], inspector, arguments))


def run_analysis(
    inspector: Inspector,
    text: str | None = None,
    *,
    model: str | None = None,
    layers: list[int] | None = None,
    experiment: bool = True,
    progress: Progress | None = None,
    long_context: bool | None = None,
    long_context_tokens: int = LONG_CONTEXT_TOKENS,
) -> AnalysisResult:
    """Run every analysis on ``text`` (a built-in text when None); expected failures of the input raise.

    ``experiment=False`` skips the training experiment (a fixed ~1.5 s, independent of the text).
    ``long_context=None`` adds retrieval heads and the short-cache plan when the text has at least
    ``long_context_tokens`` tokens (:mod:`agent_tools.report.long_context`; many forwards), ``True`` whatever its
    length (a tool that refuses the text is skipped with its reason), ``False`` never.
    """
    outcomes = StepOutcomes(say=progress or (lambda _message: None))
    text = text if text is not None else DEFAULT_TEXT
    start = time.perf_counter()
    outcomes.say("loading model")
    loaded = inspector.model(model)
    outcomes.timings["load"] = time.perf_counter() - start
    encoded = inspector.encode(loaded, text)
    if layers is not None:
        layers = check_indices(layers, loaded.facts.num_layers, "layers")
    maps = _head_maps(inspector, loaded, encoded)
    every_layer = layers if layers is not None else list(range(loaded.facts.num_layers))
    lead = PassPlan(loaded, encoded, [maps], lambda _output: maps, layers=every_layer)

    # The maps, diagnose_collapse and profile_heads' text roles stream from one forward pass; explain_scaling,
    # inspect_projections and reconstruct_attention, on the most collapsed head (known only after that pass), from
    # that head's layer run again on the call the first pass recorded (no second pass through the layers before it).
    outcomes.say("capturing every head's attention")
    whole = _plan_steps(text, model, layers=layers)
    with inspector.recorded_attention_calls(loaded) as calls:
        shared = _run_steps(inspector, whole, outcomes, pass_name="capture", lead=lead)
    outcomes.say("examining the most collapsed head")
    focus = _plan_steps(text, model, focus=most_collapsed_head(maps))
    _run_steps(inspector, focus, outcomes, pass_name="focus_pass", replay=calls)
    calls.clear()  # the recorded hidden states go before the probe and the experiment
    probe = _induction_probe(inspector, loaded, outcomes)
    if experiment and "scaling_experiment" in TOOLS:
        outcomes.attempt("scaling_experiment", partial(TOOLS["scaling_experiment"], inspector, EXPERIMENT_ARGUMENTS))
    elif not experiment:
        outcomes.skipped["scaling_experiment"] = "not asked for (--no-experiment)"
    _long_context(inspector, loaded, text, model, encoded.length, outcomes, long_context, long_context_tokens)
    return _result(loaded, encoded, maps, outcomes, shared=shared, probe=probe)


def _result(
    loaded: LoadedModel,
    encoded: Encoded,
    maps: QuantisedMaps,
    outcomes: StepOutcomes,
    *,
    shared: dict[str, PassPlan[Report]],
    probe: ProbeView | None,
) -> AnalysisResult:
    """Everything the outputs need, with what did not run (and why) in ``skipped``."""
    if maps.maps is None:
        outcomes.skipped["interactive view"] = (
            f"text has {encoded.length} tokens; maps are kept up to {MAX_INTERACTIVE_TOKENS}"
        )
    rebuilt = outcomes.reconstruction
    return AnalysisResult(
        model=loaded.name,
        dtype=str(loaded.dtype).removeprefix("torch."),
        device=str(loaded.device),
        text=encoded.text,
        tokens=encoded.tokens,
        reports=outcomes.reports,
        maps=maps,
        timings=outcomes.timings,
        skipped=outcomes.skipped,
        collapse_rows=_collapse_rows(shared, loaded, encoded),
        stages=stage_views(rebuilt, encoded.tokens) if rebuilt is not None else None,
        neuron=neuron_data(rebuilt) if rebuilt is not None else None,
        probe=probe,
    )
