"""The local engine: one process, the data streamed in batches of similar length, one part written per batch."""

from __future__ import annotations

from collections.abc import Iterable

from agent_tools.corpus.flow import EngineRun, batches_by_length
from agent_tools.corpus.tasks import analyse
from agent_tools.inspector import current_call
from agent_tools.runs.items import CorpusItem, ItemOutcome


def run_local(run: EngineRun, items: Iterable[CorpusItem]) -> None:
    """Analyse every item in this process; each finished batch is committed before the next starts.

    Stops (raising :class:`~agent_tools.corpus.flow.TooManyErrors`) at the first bad row over the budget, after
    committing the items analysed so far. Inside a call (:func:`agent_tools.session.call_scope`) it checks the
    call's cancel flag and deadline between items.
    """
    call = current_call()
    for batch in batches_by_length(items, run.batch_size):
        outcomes: list[ItemOutcome] = []
        for item in batch:
            if call is not None:
                call.check()
            outcome = analyse(run.inspector, run.task, item, run.options)
            outcomes.append(outcome)
            run.progress.advance()
            if run.budget.note([outcome]):
                break
        run.store.write_part(outcomes)
        run.budget.check()
