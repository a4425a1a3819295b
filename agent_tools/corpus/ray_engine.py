"""The Ray engine: a fixed pool of Ray actors, one model per actor, batches handed out and results committed as they
come back, actor deaths survived up to a stated bound.

The driver reads the data (skipping what a resumed run has done), cuts it into batches of similar length and
hands them to ``actors`` :class:`CorpusActor` (``num_gpus`` per actor). Each actor builds the session's inspector
(same model policy, placement, limits) and loads the model once; it runs the very same per-item analysis as the
local engine (:func:`agent_tools.corpus.tasks.analyse`), so both engines give identical tables. The driver writes
each returned batch as one part of the run folder, so a Ray run is resumable too (by either engine).

**Fail or finish, never hang.** The driver supervises the pool itself rather than leaving it to Ray: Ray Data's
actor pool restarts a dead actor and retries its task without limit by default (``max_restarts=-1``,
``max_task_retries=-1``), so a pool whose actors keep dying (an OOM killer, a preempted node) runs for ever and
reports nothing. Here every actor is created with ``max_restarts=0`` and every call with ``max_task_retries=0``;
when an actor dies the driver starts a replacement and hands the dead actor's batch to the pool again, at most
``max_restarts`` times in the run and at most ``max_task_retries`` times per batch. Past either bound the run
stops with :class:`ActorsKeptDying` naming the bound, after committing every batch that came back (a rerun
continues from there). Each death, each replacement and the count of items done are logged
(``agent_tools.corpus``) while it runs.

``address`` joins an existing cluster (``ray.init(address=...)``: the workers there need this package
installed); otherwise a local Ray is started for the run and shut down after it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from agent_tools.corpus.flow import EngineRun, batches_by_length
from agent_tools.corpus.tasks import Task, TaskOptions, analyse
from agent_tools.errors import InvalidInputError, ResourceLimitError
from agent_tools.inspector import Inspector, current_call
from agent_tools.runs.items import CorpusItem, ItemOutcome

LOCAL_OBJECT_STORE = 256 * 1024**2  # items and results are small: a local Ray needs little shared memory
WAIT_S = 5.0  # the driver wakes at least this often: to check the call's cancel flag and log progress
log = logging.getLogger("agent_tools.corpus")


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def check_ray() -> None:
    """Refuse ``--engine ray`` in one line when Ray is not installed."""
    if not ray_available():
        msg = "--engine ray needs Ray, which is not installed: pip install 'attention-explainer[corpus]'"
        raise InvalidInputError(msg, field="engine")


@dataclass(frozen=True)
class RayOptions:
    """The actor pool: how many actors, GPUs (fractions allowed) and CPU threads each, the cluster to join, and
    how many actor deaths the run survives (``max_restarts`` in the run, ``max_task_retries`` per batch)."""

    actors: int = 2
    actor_gpus: float = 0.0
    actor_cpus: int = 1
    address: str | None = None
    max_restarts: int = 3
    max_task_retries: int = 2


class ActorsKeptDying(ResourceLimitError):
    """The pool's actors died more often than the run's bound: the run stops (every returned batch is kept)."""


def session_arguments(inspector: Inspector) -> dict[str, Any]:
    """What an actor needs to rebuild the driver's inspector: the operator's policy, placement and limits."""
    names = ("policy", "placement", "token_limit", "memory_budget")
    return {name: getattr(inspector, name) for name in names}


class CorpusActor:
    """One Ray actor: the model loaded once in ``__init__``, then one batch of items per call."""

    def __init__(self, session: dict[str, Any], threads: int, task: Task, options: TaskOptions) -> None:
        import torch

        torch.set_num_threads(threads)
        self.inspector = Inspector(**session)
        self.task, self.options = task, options
        self.inspector.model(options.model)  # load now, not on the first item

    def pid(self) -> int:
        """The actor's process id (for the driver's log: which process died)."""
        return os.getpid()

    def analyse(self, items: list[CorpusItem]) -> list[ItemOutcome]:
        return [analyse(self.inspector, self.task, item, self.options) for item in items]


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
    except Exception as exc:  # Ray raises a bare Exception when its node does not come up in time (a busy machine)
        where = f"the Ray cluster at {options.address!r}" if options.address else "a local Ray"
        msg = f"could not start or join {where}: {' '.join(str(exc).split())[:300]}; check Ray, then rerun"
        raise ResourceLimitError(msg, field="ray_address") from exc
    return True


@dataclass
class Batch:
    """Items handed to one actor call, and how many times an actor died running them."""

    items: list[CorpusItem]
    attempts: int = 0


@dataclass
class Pool:
    """The actors, the batches waiting and in flight, and the deaths so far (the driver's bookkeeping)."""

    options: RayOptions
    actor_args: tuple[Any, ...]
    queue: deque[Batch]
    idle: list[Any] = field(default_factory=list)
    flight: dict[Any, tuple[Any, Batch]] = field(default_factory=dict)  # result ref -> (actor, batch)
    restarts: int = 0
    done: int = 0
    failure: str = ""  # set when a bound is crossed: no more work is handed out

    def start(self) -> Any:
        import ray

        remote = ray.remote(CorpusActor).options(
            num_cpus=self.options.actor_cpus,
            num_gpus=self.options.actor_gpus or None,
            max_restarts=0,  # the driver replaces dead actors itself, counting them (see the module's docstring)
            max_task_retries=0,
        )
        return remote.remote(*self.actor_args)

    def submit(self) -> None:
        while self.idle and self.queue:
            actor, batch = self.idle.pop(), self.queue.popleft()
            self.flight[actor.analyse.remote(batch.items)] = (actor, batch)

    def died(self, actor: Any, batch: Batch, error: Exception) -> None:
        """Count the death; retry the batch on a replacement actor, or, past a bound, stop handing out work (the
        batches still in flight are awaited and committed; then :meth:`check` raises)."""
        import ray

        ray.kill(actor, no_restart=True)
        batch.attempts += 1
        self.restarts += 1
        options = self.options
        cause = " ".join(str(error).split())[:300]
        if self.failure:
            return
        if self.restarts > options.max_restarts or batch.attempts > options.max_task_retries:
            bound = (
                f"{self.restarts} actor deaths, more than max_restarts {options.max_restarts}"
                if self.restarts > options.max_restarts
                else f"a batch of {len(batch.items)} items lost its actor {batch.attempts} times, "
                f"more than max_task_retries {options.max_task_retries}"
            )
            self.failure = f"Ray run stopped: {bound} (last: {cause})"
            self.queue.clear()
            return
        log.warning(
            "corpus: a Ray actor died (%s); restart %d of at most %d; its batch of %d items is retried (%d of %d)",
            cause, self.restarts, options.max_restarts, len(batch.items), batch.attempts,
            options.max_task_retries,
        )  # fmt: skip
        self.queue.appendleft(batch)
        self.idle.append(self.start())

    def check(self) -> None:
        """Raise :class:`ActorsKeptDying` once a bound was crossed and the batches in flight are back."""
        if self.failure and not self.flight:
            msg = (
                f"{self.failure}; {self.done} items of this run were committed and a rerun continues from them; "
                "find what kills the actors (memory: fewer --actors or a smaller --batch-size) or raise --max-restarts"
            )
            raise ActorsKeptDying(msg, field="max_restarts")


def run_ray(run: EngineRun, items: Iterable[CorpusItem], ray_options: RayOptions) -> None:
    """Analyse every item on the actor pool; each batch that comes back is committed as it arrives.

    Raises :class:`ActorsKeptDying` past the pool's bounds and :class:`~agent_tools.corpus.flow.TooManyErrors`
    past the error budget, in both cases after committing every batch that came back.
    """
    batches = deque(Batch(batch) for batch in batches_by_length(items, run.batch_size))
    if not batches:
        return
    import ray

    total = sum(len(batch.items) for batch in batches)
    started = _connect(ray_options)
    actor_args = (session_arguments(run.inspector), ray_options.actor_cpus, run.task, run.options)
    pool = Pool(ray_options, actor_args, batches)
    call = current_call()
    try:
        pool.idle = [pool.start() for _ in range(min(ray_options.actors, len(batches)))]
        pool.submit()
        while pool.flight:
            ready, _ = ray.wait(list(pool.flight), num_returns=1, timeout=WAIT_S)
            if call is not None:
                call.check()
            if not ready:
                log.info("corpus: %d of %d items done, %d actor restarts", pool.done, total, pool.restarts)
                continue
            actor, batch = pool.flight.pop(ready[0])
            try:
                outcomes: list[ItemOutcome] = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:  # the actor's process died (killed, OOM, lost node)
                pool.died(actor, batch, exc)
                run.progress.describe(f"{pool.restarts} actor restarts")
                pool.submit()
                pool.check()
                continue
            run.store.write_part(outcomes)
            pool.done += len(outcomes)
            run.progress.advance(len(outcomes))
            log.info("corpus: %d of %d items done, %d actor restarts", pool.done, total, pool.restarts)
            run.budget.note(outcomes)
            run.budget.check()
            pool.idle.append(actor)
            pool.submit()
            pool.check()
    finally:
        if started:
            ray.shutdown()
        else:  # a cluster we joined keeps running: our actors go
            for actor in [*pool.idle, *(actor for actor, _ in pool.flight.values())]:
                ray.kill(actor, no_restart=True)
