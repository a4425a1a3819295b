"""A run's table, aggregated: per head (or per segment) the mean, spread and bootstrap confidence interval of each
score over the items, and how stable each head's role is across the corpus.

Definitions (every number of ``summary.json``):

* ``mean``, ``std`` (population, ddof 0), ``q10``/``q90``: over the items where the value exists.
* ``ci_low``/``ci_high``: the percentile bootstrap interval of the mean at ``confidence`` (0.95): ``resamples``
  multinomial resamples of the items (with replacement, fixed ``seed``), the same resamples for every head and
  score, so the intervals are reproducible and comparable.
* a head's ``role`` is its most frequent primary role (profile: ``primary_role``, ``none`` when no role reaches
  its threshold; collapse: the ``verdict``) and ``role_share`` the share of items where it takes that role. A head
  is **stable** when ``role_share`` ≥ :data:`STABLE_SHARE` (0.8), **variable** otherwise.
* trace: per segment name (``system#1``, ``user#1``, a named span, ``template``, ``sink``) and per kind (the
  shares of one item's segments of a kind added up): ``presence`` (share of items having it), the shares, and
  ``read_most_rate``: how often the answer read it most, over the items having it.

Pure pandas/numpy: no model, no tools.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from agent_tools.schemas import head_label

STABLE_SHARE = 0.8
CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 1000
DEFAULT_SEED = 0
RESAMPLE_CHUNK = 64  # resamples drawn at once: (64, items) counts in memory
HEAD_METRICS = {
    "profile": ("mean_entropy", "mean_normalised_entropy", "mean_max_weight", "sink_fraction", "collapsed"),
    "collapse": (
        "mean_entropy",
        "mean_normalised_entropy",
        "mean_max_weight",
        "saturated_fraction",
        "sink_fraction",
        "dominant_share",
        "collapsed",
    ),
}
ROLE_COLUMN = {"profile": "primary_role", "collapse": "verdict"}
NO_ROLE = {"profile": "none", "collapse": "not_collapsed"}
TRACE_METRICS = (
    "share",
    "share_without_sink",
    "last_layer_share",
    "rollout_share",
    "rollout_share_without_sink",
    "read_most",
)
TRACE_SUMS = ("share", "last_layer_share", "rollout_share", "rollout_share_without_sink", "share_without_sink")


def number(value: float) -> float | None:
    """A JSON number: rounded to 6 digits; NaN (no value) becomes None."""
    value = float(value)
    return round(value, 6) if math.isfinite(value) else None


def bootstrap_interval(
    values: np.ndarray, *, resamples: int, seed: int, confidence: float = CONFIDENCE
) -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap interval of each column's mean; ``values`` is (items, columns), NaN = no value.

    Each resample draws the items with replacement (multinomial counts); a column's mean in a resample is taken
    over the drawn items that have a value. Returns (low, high), each (columns,).
    """
    count, width = values.shape
    if count == 0 or width == 0:
        empty = np.full(width, np.nan)
        return empty, empty.copy()
    rng = np.random.default_rng(seed)
    present = ~np.isnan(values)
    filled = np.where(present, values, 0.0)
    means = np.empty((resamples, width))
    for start in range(0, resamples, RESAMPLE_CHUNK):
        size = min(RESAMPLE_CHUNK, resamples - start)
        draws = rng.multinomial(count, np.full(count, 1.0 / count), size=size).astype(np.float64)  # (size, items)
        with np.errstate(invalid="ignore", divide="ignore"):
            means[start : start + size] = (draws @ filled) / (draws @ present)
    tail = (1.0 - confidence) / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column has no interval
        low, high = np.nanquantile(means, [tail, 1.0 - tail], axis=0)
    return low, high


def _stats(column: np.ndarray, low: float, high: float) -> dict[str, float | None]:
    present = column[~np.isnan(column)]
    if present.size == 0:
        return {"mean": None, "std": None, "q10": None, "q90": None, "ci_low": None, "ci_high": None}
    q10, q90 = np.quantile(present, [0.1, 0.9])
    return {
        "mean": number(present.mean()),
        "std": number(present.std()),
        "q10": number(q10),
        "q90": number(q90),
        "ci_low": number(low),
        "ci_high": number(high),
    }


def _matrices(frame: Any, key: list[str], metrics: list[str], groups: list[Any]) -> np.ndarray:
    """(items, groups × metrics): metric-major blocks of each group's value per item (NaN where absent)."""
    blocks = []
    for metric in metrics:
        pivot = frame.pivot_table(index="item", columns=key, values=metric, aggfunc="first", dropna=False)
        blocks.append(pivot.reindex(columns=groups).to_numpy(dtype=np.float64))
    return np.concatenate(blocks, axis=1) if blocks else np.empty((0, 0))


def _group_stats(
    frame: Any, key: list[str], metrics: list[str], groups: list[Any], *, resamples: int, seed: int, confidence: float
) -> list[dict[str, dict[str, float | None]]]:
    """Every group's stats of every metric, with one shared set of bootstrap resamples."""
    values = _matrices(frame, key, metrics, groups)
    low, high = bootstrap_interval(values, resamples=resamples, seed=seed, confidence=confidence)
    out: list[dict[str, dict[str, float | None]]] = []
    for g in range(len(groups)):
        columns = [m * len(groups) + g for m in range(len(metrics))]
        out.append({metric: _stats(values[:, c], low[c], high[c]) for metric, c in zip(metrics, columns, strict=True)})
    return out


def _role_stability(frame: Any, task: str) -> dict[tuple[int, int], dict[str, Any]]:
    """Per head: the most frequent role, its share of the items, and the share of every role seen."""
    roles = frame[ROLE_COLUMN[task]].fillna(NO_ROLE[task])
    found: dict[tuple[int, int], dict[str, Any]] = {}
    for (layer, head), counts in (
        roles.groupby([frame["layer"], frame["head"]]).value_counts(normalize=True).groupby(level=[0, 1])
    ):
        shares = {str(index[2]): float(share) for index, share in counts.items()}
        role = min(shares, key=lambda r: (-shares[r], r))  # ties: alphabetical, so the choice is reproducible
        found[(int(layer), int(head))] = {"role": role, "role_share": number(shares[role]), "roles": shares}
    return found


def head_summary(task: str, table: Any, *, resamples: int, seed: int, confidence: float) -> dict[str, Any]:
    """Per head: items, role stability and every score's stats; the stable and variable heads; counts per role."""
    frame = table.copy()
    if "collapsed" in frame:
        frame["collapsed"] = frame["collapsed"].astype(np.float64)
    metrics = [c for c in frame.columns if c.startswith("score_")] + [m for m in HEAD_METRICS[task] if m in frame]
    heads = sorted({(int(layer), int(head)) for layer, head in zip(frame["layer"], frame["head"], strict=True)})
    stats = _group_stats(
        frame, ["layer", "head"], metrics, heads, resamples=resamples, seed=seed, confidence=confidence
    )
    stability = _role_stability(frame, task)
    counts = frame.groupby(["layer", "head"])["item"].nunique()
    rows = []
    for (layer, head), head_stats in zip(heads, stats, strict=True):
        roles = stability[(layer, head)]
        shares = {r: number(s) for r, s in sorted(roles["roles"].items(), key=lambda kv: (-kv[1], kv[0]))}
        rows.append(
            {
                "layer": layer,
                "head": head,
                "label": head_label(layer, head),
                "items": int(counts[(layer, head)]),
                "role": roles["role"],
                "role_share": roles["role_share"],
                "stable": (roles["role_share"] or 0.0) >= STABLE_SHARE,
                "roles": shares,
                "metrics": head_stats,
            }
        )
    return {"heads": rows, **_head_lists(task, rows)}


def _head_lists(task: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    stable = [r for r in rows if r["stable"] and r["role"] != NO_ROLE[task]]
    variable = [r for r in rows if not r["stable"]]
    per_role: dict[str, dict[str, int]] = {}
    for row in rows:
        entry = per_role.setdefault(row["role"], {"heads": 0, "stable": 0})
        entry["heads"] += 1
        entry["stable"] += int(row["stable"])
    return {
        "stable_heads": [
            {"head": r["label"], "role": r["role"], "share": r["role_share"]}
            for r in sorted(stable, key=lambda r: (-r["role_share"], r["layer"], r["head"]))
        ],
        "variable_heads": [
            {"head": r["label"], "role": r["role"], "share": r["role_share"], "roles": r["roles"]}
            for r in sorted(variable, key=lambda r: (r["role_share"], r["layer"], r["head"]))
        ],
        "roles": dict(sorted(per_role.items(), key=lambda kv: (-kv[1]["heads"], kv[0]))),
    }


def _by_kind(table: Any, metrics: list[str]) -> Any:
    """One row per (item, kind): the shares of the item's segments of that kind added up; read_most if any is."""
    sums = {m: "sum" for m in metrics if m in TRACE_SUMS}
    grouped = table.groupby(["item", "kind"], as_index=False).agg({**sums, "read_most": "max"})
    return grouped.rename(columns={"kind": "group"})


def trace_summary(table: Any, *, resamples: int, seed: int, confidence: float) -> dict[str, Any]:
    """Per segment name and per segment kind: presence, share stats, and how often the answer read it most."""
    items = int(table["item"].nunique())
    metrics = [m for m in TRACE_METRICS if m in table]
    frame = table.assign(read_most=table["read_most"].astype(np.float64), group=table["segment"])
    kinds = _by_kind(table.assign(read_most=table["read_most"].astype(np.float64)), metrics)
    out: dict[str, Any] = {}
    for name, grouped in (("segments", frame), ("kinds", kinds)):
        groups = sorted(set(grouped["group"]), key=lambda g: (-int((grouped["group"] == g).sum()), str(g)))
        stats = _group_stats(grouped, ["group"], metrics, groups, resamples=resamples, seed=seed, confidence=confidence)
        rows = []
        for group, group_stats in zip(groups, stats, strict=True):
            present = int(grouped.loc[grouped["group"] == group, "item"].nunique())
            row: dict[str, Any] = {name[:-1]: group, "items": present, "presence": number(present / max(items, 1))}
            if name == "segments":
                row["kind"] = str(table.loc[table["segment"] == group, "kind"].iloc[0])
            row["read_most_rate"] = group_stats.pop("read_most")
            row["metrics"] = group_stats
            rows.append(row)
        out[name] = rows
    leaders = table.loc[table["read_most"].astype(bool), "segment"].value_counts()
    out["read_most"] = {str(k): int(v) for k, v in sorted(leaders.items(), key=lambda kv: (-kv[1], str(kv[0])))}
    return out


def summarise(
    task: str,
    table: Any,
    errors: Any,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    confidence: float = CONFIDENCE,
) -> dict[str, Any]:
    """The summary of a run's table (pandas DataFrames of rows and of errors), as plain JSON-ready data."""
    analysed = int(table["item"].nunique()) if len(table) else 0
    kinds = errors["kind"].value_counts() if len(errors) else {}
    body: dict[str, Any] = {
        "task": task,
        "items": analysed + len(errors),
        "analysed": analysed,
        "errors": len(errors),
        "error_kinds": {str(k): int(v) for k, v in dict(kinds).items()},
        "bootstrap": {"resamples": resamples, "seed": seed, "confidence": confidence},
        "stable_share": STABLE_SHARE,
    }
    options: dict[str, Any] = {"resamples": resamples, "seed": seed, "confidence": confidence}
    if task == "trace":
        empty: dict[str, Any] = {"segments": [], "kinds": [], "read_most": {}}
        return body | (trace_summary(table, **options) if len(table) else empty)
    empty = {"heads": [], "stable_heads": [], "variable_heads": [], "roles": {}}
    return body | (head_summary(task, table, **options) if len(table) else empty)
