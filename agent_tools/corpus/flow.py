"""What both engines share: what a run gives them, batches of similar length, the error budget (``--max-errors``), the
progress bar."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from agent_tools.errors import InvalidInputError
from agent_tools.runs.items import CorpusItem, ItemOutcome

if TYPE_CHECKING:
    from agent_tools.corpus.tasks import Task, TaskOptions
    from agent_tools.inspector import Inspector
    from agent_tools.runs.store import RunStore

WINDOW_BATCHES = 8  # batches read ahead and sorted by length together


def batches_by_length(items: Iterable[CorpusItem], batch_size: int) -> Iterator[list[CorpusItem]]:
    """Batches of ``batch_size`` items of similar length: read a window of ``WINDOW_BATCHES`` batches ahead, sort
    it by size, cut it. Streams: at most one window is in memory. Which items share a batch never changes a
    number (every item is its own forward pass); it evens out the batches' cost (the Ray actors' work)."""
    window: list[CorpusItem] = []
    for item in items:
        window.append(item)
        if len(window) == batch_size * WINDOW_BATCHES:
            yield from _cut(window, batch_size)
            window = []
    yield from _cut(window, batch_size)


def _cut(window: list[CorpusItem], batch_size: int) -> Iterator[list[CorpusItem]]:
    ordered = sorted(window, key=lambda item: (item.size, item.index))
    for start in range(0, len(ordered), batch_size):
        yield ordered[start : start + batch_size]


@dataclass(frozen=True)
class EngineRun:
    """What either engine is given: the session, the task and its options, the run folder every finished batch is
    committed to, the batch size, the error budget and the progress bar."""

    inspector: Inspector
    task: Task
    options: TaskOptions
    store: RunStore
    batch_size: int
    budget: ErrorBudget
    progress: Progress


class TooManyErrors(InvalidInputError):
    """More bad rows than ``--max-errors`` allows: the run stops (what is done is kept)."""


@dataclass
class ErrorBudget:
    """Counts bad rows (those of a resumed run's earlier parts too) against ``limit`` (None = no limit)."""

    limit: int | None
    seen: int = 0
    last: str = ""

    def note(self, outcomes: Sequence[ItemOutcome]) -> bool:
        """Count the outcomes' errors; True once there are more than the limit."""
        for outcome in outcomes:
            if outcome.error is not None:
                self.seen += 1
                self.last = f"item {outcome.index}: {outcome.error}"
        return self.over

    @property
    def over(self) -> bool:
        return self.limit is not None and self.seen > self.limit

    def check(self) -> None:
        """Raise :class:`TooManyErrors` when there are more bad rows than the limit."""
        if self.over:
            msg = (
                f"stopped after {self.seen} bad rows, more than --max-errors {self.limit} (last: {self.last}); "
                "the errors table lists them; fix the data or raise --max-errors, and rerun to continue"
            )
            raise TooManyErrors(msg, field="max_errors")


class Progress:
    """A rich progress bar with the ETA on stderr, shown only on a terminal (or never, with ``enabled=False``)."""

    def __init__(self, total: int, *, enabled: bool | None = None, label: str = "items") -> None:
        self.total, self.label = total, label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            columns = (
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
            )
            self._bar = RichProgress(*columns, console=Console(stderr=True))
            self._task = self._bar.add_task(self.label, total=self.total)
            self._bar.start()
        return self

    def advance(self, count: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, count)

    def describe(self, note: str) -> None:
        """Add ``note`` to the bar's label (e.g. the Ray pool's restarts so far)."""
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self.label} ({note})")

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
