"""The Python API of corpus runs: :func:`run_corpus` returns the table, errors and summary (pandas / pyarrow).

    from agent_tools.corpus import run_corpus
    result = run_corpus("profile", "chats.jsonl", out="runs/chats")   # or engine="ray", actors=4, actor_gpus=0.5
    result.table          # pandas DataFrame, one row per (item, head) — or (item, segment) for "trace"
    result.arrow          # the same as a pyarrow Table
    result.errors         # item, id, kind, reason of every bad row
    result.summary        # what summary.json holds (agent_tools.corpus.aggregate documents every number)

Calling it again with the same task, data, model and ``out`` continues a run that was stopped or killed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from agent_tools.corpus.aggregate import DEFAULT_RESAMPLES, DEFAULT_SEED, summarise
from agent_tools.corpus.flow import EngineRun, ErrorBudget, Progress, TooManyErrors
from agent_tools.corpus.local import run_local
from agent_tools.corpus.page import render_page
from agent_tools.corpus.ray_engine import ActorsKeptDying, RayOptions, check_ray, run_ray
from agent_tools.corpus.tasks import Task, TaskOptions, check_task, columns
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.runs.items import check_data, count_items, data_fingerprint, read_items
from agent_tools.runs.store import RunStore

Engine = Literal["local", "ray"]
ENGINES: tuple[str, ...] = get_args(Engine)
DEFAULT_BATCH = 8


@dataclass(frozen=True)
class CorpusResult:
    """A run's outputs in memory, and the folder that holds them on disk."""

    task: Task
    out: Path
    arrow: Any  # pyarrow.Table of the rows
    arrow_errors: Any  # pyarrow.Table: item, id, kind, reason
    summary: dict[str, Any]
    complete: bool

    @property
    def table(self) -> Any:
        """The rows as a pandas DataFrame."""
        return self.arrow.to_pandas()

    @property
    def errors(self) -> Any:
        """The bad rows as a pandas DataFrame."""
        return self.arrow_errors.to_pandas()


def _check_numbers(*, batch_size: int, max_errors: int | None, resamples: int, ray_options: RayOptions) -> None:
    checks = [
        (batch_size >= 1, f"--batch-size must be at least 1, got {batch_size}"),
        (max_errors is None or max_errors >= 0, f"--max-errors must be 0 or more, got {max_errors}"),
        (resamples >= 1, f"--bootstrap must be at least 1 resample, got {resamples}"),
        (ray_options.actors >= 1, f"--actors must be at least 1, got {ray_options.actors}"),
        (ray_options.actor_gpus >= 0, f"--actor-gpus must be 0 or more, got {ray_options.actor_gpus}"),
        (ray_options.max_restarts >= 0, f"--max-restarts must be 0 or more, got {ray_options.max_restarts}"),
        (
            ray_options.max_task_retries >= 0,
            f"--max-task-retries must be 0 or more, got {ray_options.max_task_retries}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise InvalidInputError(message)


def run_corpus(
    task: str,
    data: str | Path,
    *,
    out: str | Path | None = None,
    engine: str = "local",
    inspector: Inspector | None = None,
    model: str | None = None,
    batch_size: int = DEFAULT_BATCH,
    max_errors: int | None = None,
    ray_options: RayOptions | None = None,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    progress: bool | None = None,
) -> CorpusResult:
    """Run ``task`` (profile, trace, collapse) over every item of ``data``; write and return the results.

    ``inspector`` is the session (model policy, placement, token limit; a default one if omitted); with the Ray
    engine every actor rebuilds it. ``progress`` None shows a bar only on a terminal. Raises
    :class:`~agent_tools.corpus.flow.TooManyErrors` (after writing what is done) past ``max_errors`` bad rows, and
    :class:`~agent_tools.corpus.ray_engine.ActorsKeptDying` when Ray actors died more often than the pool's bounds.
    """
    checked = check_task(task)
    if engine not in ENGINES:
        raise InvalidInputError(f"unknown engine {engine!r}; engines: {', '.join(ENGINES)}", field="engine")
    path = check_data(data)
    pool = ray_options or RayOptions()
    _check_numbers(batch_size=batch_size, max_errors=max_errors, resamples=resamples, ray_options=pool)
    if engine == "ray":
        check_ray()
    session = inspector or Inspector()
    options = TaskOptions(model=model)
    identity = {
        "task": checked,
        "data": str(path),
        "data_fingerprint": data_fingerprint(path),
        "model": session.policy.check(model),
    }
    folder = Path(out).expanduser().resolve() if out else Path.cwd() / f"corpus-{checked}-{path.stem}"  # no out
    store = RunStore(folder, identity, columns(checked))
    with store.locked():  # one run per folder: a second one is refused at once, naming this one
        store.open()
        done = store.done()
        budget = ErrorBudget(max_errors, seen=store.error_count())
        pending = (item for item in read_items(path) if item.index not in done)
        try:
            with Progress(max(count_items(path) - len(done), 0), enabled=progress, label=f"corpus {checked}") as bar:
                run = EngineRun(session, checked, options, store, batch_size, budget, bar)
                if engine == "ray":
                    run_ray(run, pending, pool)
                else:
                    run_local(run, pending)
        except (TooManyErrors, ActorsKeptDying):  # what came back is kept, and the run is marked incomplete
            finish(store, resamples=resamples, seed=seed, complete=False)
            raise
        return finish(store, resamples=resamples, seed=seed, complete=True)


def finish(store: RunStore, *, resamples: int, seed: int, complete: bool) -> CorpusResult:
    """Gather the committed parts into the final table, errors, summary and page; mark the run complete."""
    table, errors = store.results(), store.errors()
    frame, error_frame = table.to_pandas(), errors.to_pandas()
    identity = store.identity
    summary = {
        "model": identity["model"],
        "data": identity["data"],
        "complete": complete,
        **summarise(identity["task"], frame, error_frame, resamples=resamples, seed=seed),
    }
    store.write_outputs(table, errors, summary, render_page(summary, frame, error_frame))
    store.write_manifest(complete=complete, counts={"items": summary["items"], "rows": table.num_rows})
    return CorpusResult(identity["task"], store.out, table, errors, summary, complete)
