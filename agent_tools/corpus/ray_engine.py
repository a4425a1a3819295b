"""The Ray engine: Ray Data ``map_batches`` over an actor pool, one model per actor, results streamed back.

The driver reads the data (skipping what a resumed run has done), cuts it into batches of similar length and
hands them to a fixed pool of :class:`CorpusActor` (``ActorPoolStrategy(size=actors)``, ``num_gpus`` per actor).
Each actor builds the session's inspector (same model policy, placement, limits) and loads the model once; it
runs the very same per-item analysis as the local engine (:func:`agent_tools.corpus.tasks.analyse`), so both
engines give identical tables. The driver writes each returned batch as one part of the run folder, so a Ray
run is resumable too (by either engine).

``address`` joins an existing cluster (``ray.init(address=...)``: the workers there need this package
installed); otherwise a local Ray is started for the run and shut down after it.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agent_tools.corpus.flow import ErrorBudget, Progress, batches_by_length
from agent_tools.corpus.tasks import Task, TaskOptions, analyse
from agent_tools.errors import InvalidInputError
from agent_tools.inspector import Inspector
from agent_tools.loading import ModelPolicy
from agent_tools.placement import Placement
from agent_tools.runs.items import CorpusItem, ItemOutcome
from agent_tools.runs.store import RunStore

LOCAL_OBJECT_STORE = 256 * 1024**2  # items and results are small: a local Ray needs little shared memory


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def check_ray() -> None:
    """Refuse ``--engine ray`` in one line when Ray is not installed."""
    if not ray_available():
        msg = "--engine ray needs Ray Data, which is not installed: pip install 'attention-explainer[corpus]'"
        raise InvalidInputError(msg, field="engine")


@dataclass(frozen=True)
class RayOptions:
    """The actor pool: how many actors, GPUs (fractions allowed) and CPU threads each, and the cluster to join."""

    actors: int = 2
    actor_gpus: float = 0.0
    actor_cpus: int = 1
    address: str | None = None


@dataclass(frozen=True)
class ActorSession:
    """What an actor needs to rebuild the driver's inspector: the operator's policy, placement and limits."""

    policy: ModelPolicy
    placement: Placement
    token_limit: int | None
    memory_budget: int
    threads: int

    @classmethod
    def of(cls, inspector: Inspector, threads: int) -> ActorSession:
        return cls(inspector.policy, inspector.placement, inspector.token_limit, inspector.memory_budget, threads)

    def inspector(self) -> Inspector:
        return Inspector(
            policy=self.policy,
            placement=self.placement,
            token_limit=self.token_limit,
            memory_budget=self.memory_budget,
        )


class CorpusActor:
    """One Ray actor: the model loaded once in ``__init__``, then one batch of items per call."""

    def __init__(self, session: ActorSession, task: Task, options: TaskOptions) -> None:
        import torch

        torch.set_num_threads(session.threads)
        self.inspector = session.inspector()
        self.task, self.options = task, options
        self.inspector.model(options.model)  # load now, not on the first item

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        items = [CorpusItem.from_json(str(payload)) for payload in batch["payload"]]
        outcomes = [analyse(self.inspector, self.task, item, self.options) for item in items]
        return {"item": [o.index for o in outcomes], "outcome": [o.to_json() for o in outcomes]}


def _quiet_ray_data() -> None:
    """Ray Data logs every execution at INFO (and warns that its bars are off): keep the run's output ours."""
    for name in ("ray", "ray.data"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _connect(options: RayOptions) -> bool:
    """Join the cluster at ``address``, or start a local Ray sized for the pool; True when this run started it."""
    import ray

    if ray.is_initialized():
        return False
    quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
    try:
        if options.address:
            ray.init(address=options.address, **quiet)
        else:
            cpus = max(os.cpu_count() or 1, options.actors * options.actor_cpus)
            ray.init(num_cpus=cpus, include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the Ray cluster at {options.address!r}" if options.address else "a local Ray"
        raise InvalidInputError(f"could not start or join {where}: {exc}", field="ray_address") from exc
    return True


def _dataset(pending: list[dict[str, Any]], actor: dict[str, Any], options: RayOptions, batch_size: int) -> Any:
    import ray.data

    _quiet_ray_data()  # after the import: importing ray.data sets its loggers up
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the run's own bar (on a terminal) counts the items
    blocks = max(1, math.ceil(len(pending) / batch_size))
    return ray.data.from_items(pending, override_num_blocks=blocks).map_batches(
        CorpusActor,
        fn_constructor_kwargs=actor,
        batch_size=batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=options.actors),
        num_cpus=options.actor_cpus,
        num_gpus=options.actor_gpus or None,
    )


def run_ray(
    inspector: Inspector,
    task: Task,
    items: Iterable[CorpusItem],
    options: TaskOptions,
    store: RunStore,
    *,
    batch_size: int,
    budget: ErrorBudget,
    progress: Progress,
    ray_options: RayOptions,
) -> None:
    """Analyse every item on the actor pool; each batch that comes back is committed as it arrives."""
    pending = [
        {"item": item.index, "payload": item.to_json()}
        for batch in batches_by_length(items, batch_size)
        for item in batch
    ]
    if not pending:
        return
    import ray

    started = _connect(ray_options)
    actor = {"session": ActorSession.of(inspector, ray_options.actor_cpus), "task": task, "options": options}
    try:
        for batch in _dataset(pending, actor, ray_options, batch_size).iter_batches(
            batch_size=None, batch_format="numpy"
        ):
            outcomes = [ItemOutcome.from_json(str(payload)) for payload in batch["outcome"]]
            store.write_part(outcomes)
            progress.advance(len(outcomes))
            budget.note(outcomes)
            budget.check()
    finally:
        if started:
            ray.shutdown()
