"""Reading a corpus: JSONL, Parquet, or a Hugging Face ``datasets`` folder, as a stream of :class:`CorpusItem`.

Each record holds ``text`` (a string) or ``messages`` (a list of ``{role, content}``), optionally ``segments``
(named spans, as ``trace_prompt_attention`` takes them) and ``id``. A record that cannot be read (a malformed
JSON line, neither text nor messages) is still an item: it carries the ``problem`` and becomes a row of the
run's ``errors`` table. A missing or unreadable DATA path, or a format we do not read, is an input error.

pyarrow and datasets are imported only when a Parquet file or a datasets folder is read (the ``corpus``
optional dependencies), so importing this module costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agent_tools.errors import InvalidInputError

DataKind = Literal["jsonl", "parquet", "datasets"]
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
FIELDS = ("text", "messages", "segments", "id")
READ_BATCH = 1024  # rows per Parquet / datasets batch
Row = dict[str, Any]


@dataclass(frozen=True)
class CorpusItem:
    """One record of the data: its 0-based position (``index``), what to analyse, or why it cannot be read."""

    index: int
    id: str | None = None
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    segments: list[dict[str, Any]] | None = None
    problem: str | None = None

    @property
    def prompt(self) -> str | list[dict[str, Any]]:
        """The text, or the messages (for the prompt tools)."""
        if self.messages is not None:
            return self.messages
        return self.text or ""

    @property
    def size(self) -> int:
        """Characters to read: what batching by length sorts on (a cheap stand-in for the token count)."""
        if self.messages is not None:
            return sum(len(str(m.get("content", ""))) for m in self.messages if isinstance(m, dict))
        return len(self.text or "")


@dataclass(frozen=True)
class ItemOutcome:
    """One item's rows, or why it has none (``error_kind``: an error kind of :mod:`agent_tools.errors`, or
    ``malformed`` for a record that could not be read)."""

    index: int
    id: str | None
    rows: list[Row] = field(default_factory=list)
    error_kind: str | None = None
    error: str | None = None

    def error_row(self) -> Row:
        return {"item": self.index, "id": self.id, "kind": self.error_kind, "reason": self.error}


def item_from_record(index: int, record: object) -> CorpusItem:
    """A record (a decoded JSON object or a table row) as an item; what is wrong with it goes in ``problem``."""
    if not isinstance(record, dict):
        return CorpusItem(index, problem=f"record is a {type(record).__name__}, not an object with text or messages")
    raw_id = record.get("id")
    item_id = None if raw_id is None else str(raw_id)
    text, messages, segments = record.get("text"), record.get("messages"), record.get("segments")
    if (text is None) == (messages is None):
        which = "both" if text is not None else "neither"
        return CorpusItem(index, item_id, problem=f"record has {which} of 'text' and 'messages'; give exactly one")
    if text is not None and not isinstance(text, str):
        return CorpusItem(index, item_id, problem=f"'text' must be a string, got {type(text).__name__}")
    if messages is not None and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
        return CorpusItem(index, item_id, problem="'messages' must be a list of {role, content} objects")
    if segments is not None and not (isinstance(segments, list) and all(isinstance(s, dict) for s in segments)):
        return CorpusItem(index, item_id, problem="'segments' must be a list of objects (name, text or start/end)")
    clean_segments = [{k: v for k, v in s.items() if v is not None} for s in segments] if segments else None
    return CorpusItem(index, item_id, text=text, messages=messages, segments=clean_segments)


def data_kind(path: Path) -> DataKind:
    """Which reader a DATA path takes; a missing, unreadable or unknown path is an input error naming the formats."""
    if not path.exists():
        raise InvalidInputError(f"DATA {str(path)!r} does not exist; give a JSONL or Parquet file or a datasets folder")
    if not os.access(path, os.R_OK):
        raise InvalidInputError(f"DATA {str(path)!r} cannot be read (permission denied)")
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = ", ".join(sorted(p.name for p in path.iterdir() if p.is_dir()))
            msg = f"DATA {str(path)!r} is a DatasetDict (splits: {splits}); give one split's folder, e.g. {path}/train"
            raise InvalidInputError(msg)
        if (path / "state.json").is_file() or (path / "dataset_info.json").is_file():
            return "datasets"
        raise InvalidInputError(f"folder {str(path)!r} is not a datasets folder (saved with save_to_disk)")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    formats = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)
    raise InvalidInputError(f"DATA {str(path)!r} has an unknown format; give a file ending in {formats}, or a folder")


def check_data(data: str | Path) -> Path:
    """The DATA path, resolved, once it is known to exist, be readable and be of a format we read."""
    path = Path(data).expanduser().resolve()
    data_kind(path)
    return path


def read_items(path: Path) -> Iterator[CorpusItem]:
    """Every record of the data, in order, as items (streamed: a batch of rows at a time)."""
    kind = data_kind(path)
    if kind == "jsonl":
        yield from _jsonl_items(path)
        return
    records = _parquet_records(path) if kind == "parquet" else _datasets_records(path)
    yield from (item_from_record(index, record) for index, record in enumerate(records))


def count_items(path: Path) -> int:
    """How many items :func:`read_items` yields, without decoding them (progress bars, ETA)."""
    kind = data_kind(path)
    if kind == "jsonl":
        with path.open("rb") as handle:
            return sum(1 for line in handle if line.strip())
    if kind == "parquet":
        pq = _pyarrow_parquet()
        return int(pq.ParquetFile(path).metadata.num_rows)
    return len(_load_dataset(path))


def data_fingerprint(path: Path) -> str:
    """Size and modification time of the file (or of every file in the folder): a changed DATA is noticed."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}|{stat.st_size}|".encode())
        digest.update(str(stat.st_mtime_ns).encode())
    return digest.hexdigest()[:16]


def _jsonl_items(path: Path) -> Iterator[CorpusItem]:
    """One item per non-blank line; a line that is not JSON is an item with its problem (and line number)."""
    index = 0
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                yield CorpusItem(index, problem=f"line {number} is not UTF-8 ({exc.reason} at byte {exc.start})")
            except json.JSONDecodeError as exc:
                yield CorpusItem(index, problem=f"line {number} is not valid JSON ({exc.msg} at column {exc.colno})")
            else:
                yield item_from_record(index, record)
            index += 1


def _check_columns(columns: list[str], path: Path) -> list[str]:
    if "text" not in columns and "messages" not in columns:
        msg = f"DATA {str(path)!r} has no 'text' or 'messages' column; its columns: {', '.join(columns) or 'none'}"
        raise InvalidInputError(msg)
    return [c for c in FIELDS if c in columns]


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise InvalidInputError("reading Parquet needs pyarrow: pip install 'attention-explainer[corpus]'") from exc
    return pq


def _parquet_records(path: Path) -> Iterator[dict[str, Any]]:
    pq = _pyarrow_parquet()
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
        raise InvalidInputError(f"DATA {str(path)!r} is not a readable Parquet file ({exc})") from exc
    columns = _check_columns(parquet.schema_arrow.names, path)
    for batch in parquet.iter_batches(batch_size=READ_BATCH, columns=columns):
        yield from batch.to_pylist()


def _load_dataset(path: Path) -> Any:
    try:
        import datasets
    except ImportError as exc:
        msg = "reading a datasets folder needs datasets: pip install 'attention-explainer[corpus]'"
        raise InvalidInputError(msg) from exc
    try:
        return datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError / ValueError for folders it did not write
        raise InvalidInputError(f"DATA {str(path)!r} is not a readable datasets folder ({exc})") from exc


def _datasets_records(path: Path) -> Iterator[dict[str, Any]]:
    dataset = _load_dataset(path)
    columns = _check_columns(list(dataset.column_names), path)
    for start in range(0, len(dataset), READ_BATCH):
        batch = dataset.select_columns(columns)[start : start + READ_BATCH]  # column -> values
        for row in range(len(batch[columns[0]])):
            yield {column: batch[column][row] for column in columns}
