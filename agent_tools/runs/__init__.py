"""Corpus data below the tools: the data-file readers (``items``: JSONL, CSV, text, Parquet and datasets folders
into items) and the run store (``store``: parts, the final table, the summary, one run per folder). Both the
``corpus`` surface, which runs a task over items, and the ``corpus_summary`` tool, which reads a finished run,
use them; neither uses a tool, so the tool layer may import them (docs/ARCHITECTURE.md, layer 6)."""
