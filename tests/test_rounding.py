"""Reports round once, at the boundary: a field declared ``Rounded`` holds the rounded value, NaN and inf kept."""

from __future__ import annotations

import math

from pydantic import BaseModel

from agent_tools.schemas import Finding, Rounded, Rounded2, Rounded6
from agent_tools.tools.trace_prompt_attention.models import PromptTrace
from agent_tools.traced_prompt.models import GradientRun


class _Row(BaseModel):
    share: Rounded
    angle: Rounded2
    scale: Rounded6
    maybe: Rounded | None = None
    values: list[Rounded] = []


def test_fields_round_when_the_row_is_built() -> None:
    row = _Row(share=0.123456789, angle=30.264485, scale=0.1249999876, maybe=2 / 3, values=[1 / 3, 0.00004999])
    assert (row.share, row.angle, row.scale, row.maybe) == (0.1235, 30.26, 0.125, 0.6667)
    assert row.values == [0.3333, 0.0]
    assert row.model_dump_json() == (
        '{"share":0.1235,"angle":30.26,"scale":0.125,"maybe":0.6667,"values":[0.3333,0.0]}'
    )


def test_non_finite_values_are_kept_and_none_stays_none() -> None:
    row = _Row(share=math.nan, angle=math.inf, scale=-math.inf)
    assert math.isnan(row.share) and row.angle == math.inf and row.scale == -math.inf and row.maybe is None


def test_the_prompt_trace_rounds_its_rows_and_findings_when_built() -> None:
    """The trace's report takes full-precision numbers; its fields and its findings' values round once, here."""
    trace = PromptTrace(
        model="m",
        summary="s",
        findings=[Finding(kind="read_most", value=2 / 3, detail="d"), Finding(kind="note", detail="no value")],
        target="last",
        prompt_format="text",
        rendered_prompt="a b",
        num_tokens=2,
        answer_position=1,
        segments=[],
        sink_positions=[0],
        sink_threshold=0.123456,
        read_most="text",
        runner_up=None,
        margin=1 / 3,
        gradient_run=GradientRun(
            steps=4, baseline="b", value=-1.23456789, baseline_value=-2.0, delta=0.00012345678, relative_delta=0.000049
        ),
    )
    assert [f.value for f in trace.findings] == [0.6667, None]
    assert trace.margin == 0.3333 and trace.sink_threshold == 0.123456  # an argument echoed, not a measure
    run = trace.gradient_run
    assert run is not None and (run.value, run.delta, run.relative_delta) == (-1.2346, 0.000123, 0.0)
