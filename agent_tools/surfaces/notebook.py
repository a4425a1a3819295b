"""The notebook surface: ``Explainer``, every tool as a method whose report renders itself in Jupyter.

::

    from agent_tools import Explainer

    explain = Explainer()                                   # the default model; Explainer("minilm-l6") for another
    explain.diagnose_collapse("The cat sat on the mat.")    # a CollapseReport: summary, key figure, findings
    explain.show_attention("The cat sat.", layer=3, head=0)
    result = explain.analyze("When Mary and John went to the store, John gave a drink to")
    result                                                  # the story with its pictures
    result.page()                                           # the interactive page: model, attention, neuron views

The methods are generated from :data:`agent_tools.tools.TOOLS` (like every other surface), so a new tool is a
method at once: its arguments are the tool's input fields (``text`` may be given first, without its name), its
docstring the tool's description. Every call goes through the tool's declaration and one session
:class:`~agent_tools.inspector.Inspector`, so loaded models are reused between cells.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_tools.attention_cache import AttentionCache, capture_maps
from agent_tools.inspector import Inspector
from agent_tools.loading import ModelPolicy
from agent_tools.placement import Placement
from agent_tools.report import notebook_view  # noqa: F401  (registers how reports draw themselves in Jupyter)
from agent_tools.report.job import AnalysisResult, run_analysis
from agent_tools.schemas import Report
from agent_tools.tools import TOOLS
from agent_tools.tools.registry import ToolSpec


class Explainer:
    """Every tool as a method (``explain.<tool>(text, **arguments)``) and ``analyze``; reports render in Jupyter.

    Args:
        model: the model the methods use when a call names none (a bundled alias, a folder, a .gguf file or a
            hub id); None = the default model.
        inspector: a session to share (its policy, placement and limits); one is made when omitted.
        placement: dtype/device/device map for the session made here (ignored with ``inspector``).
        artifact_dir: where PNG files go when a tool is asked for one (``png=True``).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        inspector: Inspector | None = None,
        placement: Placement | None = None,
        artifact_dir: str | Path | None = None,
    ) -> None:
        policy = ModelPolicy(default=model) if model is not None else ModelPolicy()  # the notebook user's own choice
        self.inspector = inspector or Inspector(policy=policy, placement=placement, artifact_dir=artifact_dir)
        self.model = model

    def tools(self) -> list[str]:
        """The tools, each a method of this object."""
        return list(TOOLS)

    def call(self, tool: str, /, **arguments: Any) -> Report:
        """Run ``tool`` with ``arguments`` (this explainer's model unless one is given)."""
        spec = TOOLS[tool]
        if self.model is not None and "model" in spec.input_model.model_fields:
            arguments.setdefault("model", self.model)
        return spec(self.inspector, arguments)

    def analyze(
        self,
        text: str | None = None,
        *,
        layers: list[int] | None = None,
        experiment: bool = True,
        long_context: bool | None = None,
    ) -> AnalysisResult:
        """The ``attention-explainer analyze`` job: the story in pictures, every finding, the glossary.

        ``text=None`` uses the built-in text; ``experiment=False`` skips the training experiment (~1.5 s);
        ``long_context`` (None: by the text's length, see :mod:`agent_tools.report.long_context`) adds retrieval
        heads and the short-KV-cache plan.
        Display the result for the story; ``.page()`` for the interactive views; ``write_outputs`` (in
        :mod:`agent_tools.report.outputs`) for the files.
        """
        return run_analysis(
            self.inspector, text, model=self.model, layers=layers, experiment=experiment, long_context=long_context
        )

    def capture_maps(
        self, text: str, *, layers: list[int] | None = None, attention: str | None = None
    ) -> AttentionCache:
        """Every map of a short text by name, for statistics of your own (TransformerLens' ``run_with_cache``):
        ``cache["L18H6"].pattern``, ``.scores``, ``.q``/``.k``/``.v``, ``cache["pattern", 18]``. Refused over the
        session's memory budget; long texts stream through ``agent_tools.capture.capture_attention``."""
        return capture_maps(self.model, text, layers=layers, attention=attention, inspector=self.inspector)

    def __repr__(self) -> str:
        return f"Explainer(model={self.model!r}, tools={len(TOOLS)})"


def _signature(spec: ToolSpec) -> inspect.Signature:
    """``(self, text, /?, *, field=default, ...)`` from the tool's input model: ``text`` may come first."""
    fields = spec.input_model.model_fields
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for name, info in fields.items():
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if name == "text" else inspect.Parameter.KEYWORD_ONLY
        default = inspect.Parameter.empty if info.is_required() else info.get_default(call_default_factory=True)
        parameters.append(inspect.Parameter(name, kind, default=default, annotation=info.annotation))
    parameters.sort(key=lambda p: p.kind)  # positional first
    return inspect.Signature(parameters, return_annotation=spec.output_model)


def _docstring(spec: ToolSpec) -> str:
    lines = [spec.description, "", "Arguments:"]
    for name, info in spec.input_model.model_fields.items():
        lines.append(f"    {name}: {info.description or ''}")
    lines += ["", f"Returns a {spec.output_model.__name__}, which renders itself in Jupyter."]
    return "\n".join(lines)


def _method(spec: ToolSpec) -> Callable[..., Report]:
    """The tool as a method: arguments bound by its signature (unknown ones refused by the tool itself)."""
    signature = _signature(spec)

    def method(self: Explainer, *args: Any, **kwargs: Any) -> Report:
        if len(args) > 1 or (args and "text" not in spec.input_model.model_fields):
            msg = f"{spec.name} takes its arguments by name (only text may come first)"
            raise TypeError(msg)
        if args:
            kwargs["text"] = args[0]
        return self.call(spec.name, **kwargs)

    method.__name__ = method.__qualname__ = spec.name
    method.__doc__ = _docstring(spec)
    method.__signature__ = signature  # type: ignore[attr-defined]
    return method


for _name, _spec in TOOLS.items():
    if not hasattr(Explainer, _name):
        setattr(Explainer, _name, _method(_spec))
