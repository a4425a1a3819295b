"""Reports round once, at the boundary: a field declared ``Rounded`` holds the rounded value, NaN and inf kept."""

from __future__ import annotations

import math

from pydantic import BaseModel

from agent_tools.schemas import Rounded, Rounded2, Rounded6


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
