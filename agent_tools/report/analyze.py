"""The main job: run describe, collapse, scaling, head profile and projections on one text, and collect
everything the terminal, JSON, PNG and HTML outputs need.

Each step calls a tool through its declaration (the same path every surface uses); one extra capture keeps
every head's map (quantised) for the grids and the interactive view.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from agent_tools.errors import AttentionToolError
from agent_tools.inspector import Inspector
from agent_tools.report.collect import QuantisedMaps
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
    model: str
    text: str
    tokens: list[Token]
    reports: dict[str, Report]
    maps: QuantisedMaps
    timings: dict[str, float]
    skipped: dict[str, str] = field(default_factory=dict)

    def to_report(self) -> AnalysisReport:
        def grid(tensor) -> list[list[float]]:
            return [[round(float(v), 4) for v in row] for row in tensor.tolist()]

        return AnalysisReport(
            model=self.model,
            text=self.text,
            tokens=self.tokens,
            reports={name: r.model_dump(mode="json") for name, r in self.reports.items()},
            skipped=self.skipped,
            head_entropy=grid(self.maps.entropy),
            head_normalised_entropy=grid(self.maps.normalised_entropy),
            head_sink_share=grid(self.maps.sink_share),
            head_max_weight=grid(self.maps.max_weight),
            timings={k: round(v, 3) for k, v in self.timings.items()},
        )


def _most_collapsed_head(maps: QuantisedMaps) -> tuple[int, int]:
    flat = int(maps.normalised_entropy.flatten().argmin())
    return divmod(flat, maps.normalised_entropy.shape[1])


def _steps(text: str, model: str | None, focus: tuple[int, int], layers: list[int] | None) -> list[tuple[str, dict]]:
    layer, head = focus
    base: dict[str, Any] = {"text": text} | ({"model": model} if model else {})
    steps = [
        ("describe_model", {"model": model} if model else {}),
        ("diagnose_collapse", base | ({"layers": layers} if layers else {})),
        ("explain_scaling", base | {"layer": layer}),
        ("profile_heads", base | ({"layers": layers} if layers else {})),
        ("inspect_projections", base | {"layer": layer, "head": head}),
    ]
    return [(name, args) for name, args in steps if name in TOOLS]


def run_analysis(
    inspector: Inspector,
    text: str | None = None,
    *,
    model: str | None = None,
    layers: list[int] | None = None,
    progress: Progress | None = None,
) -> AnalysisResult:
    """Run every analysis on ``text`` (a built-in text when None); expected failures of the input raise."""
    say = progress or (lambda _message: None)
    text = text if text is not None else DEFAULT_TEXT
    timings: dict[str, float] = {}
    start = time.perf_counter()
    say("loading model")
    loaded = inspector.model(model)
    timings["load"] = time.perf_counter() - start
    encoded = inspector.encode(loaded, text)
    if layers is not None:
        from agent_tools.inspector import check_indices

        layers = check_indices(layers, loaded.facts.num_layers, "layers")
    facts = loaded.facts
    say("capturing every head's attention")
    start = time.perf_counter()
    # Every head's map is kept (1 byte an entry) only where the interactive view can use it.
    keep_maps = encoded.length <= MAX_INTERACTIVE_TOKENS
    if keep_maps:  # one byte per weight, every layer and head
        inspector.check_budget(facts.num_layers * facts.num_heads * encoded.length**2, "the interactive report's maps")
    maps = QuantisedMaps(facts.num_layers, facts.num_heads, encoded.length, keep_maps=keep_maps)
    inspector.run(loaded, encoded, [maps], need_output=False)
    timings["capture"] = time.perf_counter() - start
    focus = _most_collapsed_head(maps)
    reports: dict[str, Report] = {}
    skipped: dict[str, str] = {}
    for name, arguments in _steps(text, model, focus, layers):
        say(f"running {name}")
        start = time.perf_counter()
        try:
            reports[name] = TOOLS[name](inspector, arguments)
        except AttentionToolError as exc:
            skipped[name] = exc.message
        timings[name] = time.perf_counter() - start
    if not keep_maps:
        skipped["interactive view"] = f"text has {encoded.length} tokens; maps are kept up to {MAX_INTERACTIVE_TOKENS}"
    for name in ("diagnose_collapse", "explain_scaling", "profile_heads", "inspect_projections"):
        if name not in TOOLS:
            skipped[name] = "tool not available in this build"
    return AnalysisResult(
        model=loaded.name,
        text=text,
        tokens=encoded.tokens,
        reports=reports,
        maps=maps,
        timings=timings,
        skipped=skipped,
    )
