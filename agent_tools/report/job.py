"""The ``analyze`` job's orchestration: run describe, collapse, scaling, head profile and projections on one
text, and collect everything the terminal, JSON, PNG and HTML outputs need (the CLI's ``analyze`` command, in
:mod:`agent_tools.cli.analyze`, only parses options and prints).

Each step calls a tool through its declaration (the same path every surface uses). Steps whose tools declare
their pass as a plan (diagnose_collapse, profile_heads' text roles) share one forward pass with the capture that
keeps every head's map (quantised) for the grids and the interactive view.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from pydantic import BaseModel, Field

from agent_tools.consumers.grid import QuantisedMaps
from agent_tools.errors import AttentionToolError
from agent_tools.inspector import Encoded, Inspector, PassPlan, check_indices
from agent_tools.loading import LoadedModel
from agent_tools.schemas import Report, Token
from agent_tools.tools import TOOLS

DEFAULT_TEXT = (
    "When Mary and John went to the store, John gave a drink to Mary. "
    "The store was closed on Sunday, so they walked back home along the river and talked about the weather."
)
MAX_INTERACTIVE_TOKENS = 384

Progress = Callable[[str], None]


class AnalysisReport(BaseModel):
    """Every report of one ``analyze`` run, as plain JSON."""

    model: str
    dtype: str = Field(description="the precision the model ran in")
    device: str = Field(description="where it ran (a sharded model's input device)")
    text: str
    tokens: list[Token]
    reports: dict[str, dict[str, Any]] = Field(description="tool name -> that tool's report")
    skipped: dict[str, str] = Field(default_factory=dict, description="steps that did not run, and why")
    head_entropy: list[list[float]] = Field(description="layer × head mean attention entropy, nats")
    head_normalised_entropy: list[list[float]]
    head_sink_share: list[list[float]] = Field(description="layer × head mean weight on position 0")
    head_max_weight: list[list[float]]
    timings: dict[str, float] = Field(description="seconds per step")


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

    def to_report(self) -> AnalysisReport:
        def grid(tensor: torch.Tensor) -> list[list[float]]:
            return [[round(float(v), 4) for v in row] for row in tensor.tolist()]

        return AnalysisReport(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            text=self.text,
            tokens=self.tokens,
            reports={name: r.model_dump(mode="json") for name, r in self.reports.items()},
            skipped=self.skipped,
            head_entropy=grid(self.maps.entropy),
            head_normalised_entropy=grid(self.maps.normalised_entropy),
            head_sink_share=grid(self.maps.first_token_share),
            head_max_weight=grid(self.maps.max_weight),
            timings={k: round(v, 3) for k, v in self.timings.items()},
        )


def _most_collapsed_head(maps: QuantisedMaps) -> tuple[int, int]:
    flat = int(maps.normalised_entropy.flatten().argmin())
    return divmod(flat, maps.normalised_entropy.shape[1])


def _whole_model_steps(text: str, model: str | None, layers: list[int] | None) -> list[tuple[str, dict]]:
    """Steps over every head, which need nothing from the capture: they may share its pass."""
    base: dict[str, Any] = {"text": text} | ({"model": model} if model else {})
    steps = [
        ("describe_model", {"model": model} if model else {}),
        ("diagnose_collapse", base | ({"layers": layers} if layers else {})),
        ("profile_heads", base | ({"layers": layers} if layers else {})),
    ]
    return [(name, args) for name, args in steps if name in TOOLS]


def _focus_steps(text: str, model: str | None, focus: tuple[int, int]) -> list[tuple[str, dict]]:
    """Steps on the most collapsed head, chosen from the capture."""
    layer, head = focus
    base: dict[str, Any] = {"text": text} | ({"model": model} if model else {})
    steps = [
        ("explain_scaling", base | {"layer": layer}),
        ("inspect_projections", base | {"layer": layer, "head": head}),
    ]
    return [(name, args) for name, args in steps if name in TOOLS]


@dataclass
class StepOutcomes:
    """What the steps have produced so far: their reports, why others were skipped, and seconds per step."""

    say: Progress
    reports: dict[str, Report] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def attempt(self, name: str, call: Callable[[], Report | None]) -> None:
        """Run one step, timed; an expected failure of its input skips it with the error's message."""
        self.say(f"running {name}")
        start = time.perf_counter()
        try:
            report = call()
            if report is not None:
                self.reports[name] = report
        except AttentionToolError as exc:
            self.skipped[name] = exc.message
        self.timings[name] = time.perf_counter() - start


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
) -> set[str]:
    """Stream the plans that share a pass (with ``lead`` when given) from one forward pass, timed as
    ``pass_name``, and finish each; returns the names that ran (none when there is nothing to share)."""
    first = lead if lead is not None else next(iter(plans.values()), None)
    shared = {name: plan for name, plan in plans.items() if first is not None and first.shares_pass_with(plan)}
    if lead is None and len(shared) <= 1:
        return set()
    start = time.perf_counter()
    together = ([lead] if lead is not None else []) + list(shared.values())
    try:
        output = inspector.run_together(together)
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
) -> None:
    """Run ``steps``; those whose tools declare a plan sharing one pass (with ``lead`` when given) stream from a
    single forward pass, timed as ``pass_name``. The rest, or all if the shared pass fails, run one by one."""
    plans = _prepare_plans(inspector, steps, outcomes)
    done = _run_shared_pass(inspector, plans, outcomes, pass_name=pass_name, lead=lead)
    for name, arguments in steps:
        if name not in done and name not in outcomes.skipped:
            outcomes.attempt(name, partial(TOOLS[name], inspector, arguments))


def _head_maps(inspector: Inspector, loaded: LoadedModel, encoded: Encoded) -> QuantisedMaps:
    """The consumer keeping every head's statistics, and every map (1 byte an entry) only where the interactive
    view can use it: texts up to ``MAX_INTERACTIVE_TOKENS`` tokens, within the memory budget."""
    facts = loaded.facts
    keep_maps = encoded.length <= MAX_INTERACTIVE_TOKENS
    if keep_maps:  # one byte per weight, every layer and head
        inspector.check_budget(facts.num_layers * facts.num_heads * encoded.length**2, "the interactive report's maps")
    return QuantisedMaps(facts.num_layers, facts.num_heads, encoded.length, keep_maps=keep_maps)


def run_analysis(
    inspector: Inspector,
    text: str | None = None,
    *,
    model: str | None = None,
    layers: list[int] | None = None,
    progress: Progress | None = None,
) -> AnalysisResult:
    """Run every analysis on ``text`` (a built-in text when None); expected failures of the input raise."""
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

    # The maps, diagnose_collapse and profile_heads' text roles stream from one forward pass; explain_scaling and
    # inspect_projections, on the most collapsed head's layer, from a second one that stops after that layer.
    outcomes.say("capturing every head's attention")
    _run_steps(inspector, _whole_model_steps(text, model, layers), outcomes, pass_name="capture", lead=lead)
    outcomes.say("examining the most collapsed head")
    _run_steps(inspector, _focus_steps(text, model, _most_collapsed_head(maps)), outcomes, pass_name="focus_pass")
    if maps.maps is None:
        outcomes.skipped["interactive view"] = (
            f"text has {encoded.length} tokens; maps are kept up to {MAX_INTERACTIVE_TOKENS}"
        )
    for name in ("diagnose_collapse", "explain_scaling", "profile_heads", "inspect_projections"):
        if name not in TOOLS:
            outcomes.skipped[name] = "tool not available in this build"
    return AnalysisResult(
        model=loaded.name,
        dtype=str(loaded.dtype).removeprefix("torch."),
        device=str(loaded.device),
        text=text,
        tokens=encoded.tokens,
        reports=outcomes.reports,
        maps=maps,
        timings=outcomes.timings,
        skipped=outcomes.skipped,
    )
