"""Corpus runs: one task (profile, trace, collapse) over every item of a data file, on one process or on Ray.

* :mod:`.items` — the readers (JSONL, Parquet, a ``datasets`` folder) and the item / outcome records;
* :mod:`.tasks` — the per-item analysis, through the tools' own declarations (a row equals the tool's numbers);
* :mod:`.local`, :mod:`.ray_engine` — the two engines (:mod:`.flow`: what they share: batches by length, the
  error budget, the progress bar);
* :mod:`.store` — the resumable output folder; :mod:`.aggregate` — the summary (bootstrap intervals, stable
  and variable heads); :mod:`.page` — the self-contained HTML page;
* :mod:`.api` — :func:`run_corpus`, the Python API (the ``corpus`` CLI subcommand calls it).

Layers: ``tasks``, the engines and ``api`` call tools (the surfaces' layer, like ``report/``); ``items``,
``store``, ``aggregate`` and ``page`` use no tool, so a tool (``corpus_summary``) may read a run through them.
This package's ``__init__`` therefore imports nothing eagerly: ``run_corpus`` and ``CorpusResult`` load on first
use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent_tools.corpus.api import CorpusResult, run_corpus

__all__ = ["CorpusResult", "run_corpus"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from agent_tools.corpus import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
