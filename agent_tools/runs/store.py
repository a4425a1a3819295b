"""A run's output folder, written as the run goes, so that a killed run continues where it stopped.

    OUT/run.json                 what the run is (task, data and its fingerprint, model, options) and whether it is
                                 complete; a rerun with the same identity continues, another one is refused
    OUT/parts/part-NNNNNN.*      one part per finished batch: ``.results.parquet``, ``.errors.parquet``, then
                                 ``.done.json`` (the items it covers), written last: a part without it never counts
    OUT/table.parquet            every part's rows, sorted by item (each item's rows in the tool's order)
    OUT/errors.parquet           item, id, kind, reason of every bad row
    OUT/summary.json, OUT/report.html
    OUT/.run.lock, OUT/.run.owner.json   the lock one run holds while it writes, and who holds it (PID, host;
                                         removed on release)

Every file is written to a temporary name and renamed, so a kill leaves either the whole file or none. The
final table depends only on which items are done, never on how the work was split into parts, so a resumed
run's table equals an uninterrupted one's.

One run per folder: :meth:`RunStore.locked` takes an exclusive lock on the folder (``filelock``: ``flock`` on
POSIX, ``LockFileEx`` on Windows, released by the system when its holder dies, so a killed run's lock is simply
taken over). A second run on the same folder is refused at once, naming the holder's PID and host. And the
table never holds an item twice: each item's rows come from the first committed part that covers it, whatever
a folder written without the lock (an older version, a file system without locks) holds.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agent_tools.errors import InvalidInputError
from agent_tools.files import remove_stale_partials, write_atomic
from agent_tools.runs.items import ItemOutcome

logger = logging.getLogger(__name__)

MANIFEST = "run.json"
PARTS = "parts"
TABLE = "table.parquet"
ERRORS = "errors.parquet"
SUMMARY = "summary.json"
PAGE = "report.html"
LOCK = ".run.lock"
OWNER = ".run.owner.json"
_RUN_FILES = frozenset({LOCK, OWNER})  # what the lock puts in a new folder: it is still empty for ``open``
FORMAT = 1
ERROR_COLUMNS = [("item", "int"), ("id", "str"), ("kind", "str"), ("reason", "str")]
_PART = re.compile(r"^part-(\d{6})\.")

Columns = Sequence[tuple[str, str]]


def arrow_schema(columns: Columns) -> Any:
    """The pyarrow schema of ``(name, kind)`` columns, kind one of int, float, str, bool."""
    import pyarrow as pa

    types = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "bool": pa.bool_()}
    return pa.schema([(name, types[kind]) for name, kind in columns])


def write_table(path: Path, table: Any) -> None:
    """A pyarrow table as a Parquet file, atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    write_atomic(path, sink.getvalue().to_pybytes())


class RunStore:
    """The output folder of one run: its identity, the committed parts, and the final files."""

    def __init__(self, out: Path, identity: dict[str, Any], columns: Columns) -> None:
        self.out = out
        self.parts = out / PARTS
        self.identity = {"format": FORMAT, **identity}
        self.schema = arrow_schema(columns)
        self.error_schema = arrow_schema(ERROR_COLUMNS)

    # --- one run per folder ------------------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the folder's exclusive lock for the block; refuse at once when another run holds it."""
        from filelock import FileLock, Timeout

        if self.out.exists() and not self.out.is_dir():
            msg = f"--out {str(self.out)!r} exists and is not a corpus run folder; give a new or empty folder"
            raise InvalidInputError(msg, field="out")
        self.out.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.out / LOCK, timeout=0, thread_local=False)
        try:
            lock.acquire()
        except Timeout as exc:
            raise InvalidInputError(self._busy_message(), field="out") from exc
        try:
            owner = {"pid": os.getpid(), "host": socket.gethostname()}
            write_atomic(self.out / OWNER, json.dumps(owner))
            yield
        finally:
            # The owner file names the lock's holder only while it holds it: a stale one would name a dead run.
            (self.out / OWNER).unlink(missing_ok=True)
            lock.release()

    def _busy_message(self, wait_s: float = 2.0) -> str:
        # The holder writes its owner file just after it takes the lock: a run refused in that window waits for it.
        deadline = time.monotonic() + wait_s
        while True:
            try:
                owner = json.loads((self.out / OWNER).read_text(encoding="utf-8"))
                holder = f"PID {int(owner['pid'])} on host {owner['host']}"
                break
            except (OSError, ValueError, KeyError, TypeError):
                if time.monotonic() >= deadline:
                    holder = "a process that has not said who it is yet"
                    break
                time.sleep(0.05)
        return (
            f"--out {str(self.out)!r} is in use by another corpus run ({holder}); wait for it to finish, stop it, "
            "or give another --out"
        )

    # --- opening and resuming ----------------------------------------------------------------------------
    def open(self) -> bool:
        """Create the folder, or check that the run already in it is this one; True when it is a resumed run."""
        manifest = self.out / MANIFEST
        if manifest.is_file():
            stored = read_json(manifest)
            differ = [k for k in self.identity if stored.get(k) != self.identity[k]]
            if differ:
                shown = "; ".join(f"{k}: {stored.get(k)!r} there, {self.identity[k]!r} now" for k in differ)
                msg = f"--out {str(self.out)!r} holds another run ({shown}); give another --out or remove that folder"
                raise InvalidInputError(msg, field="out")
            self._drop_unfinished()
            remove_stale_partials(self.out)
            return True
        if self.out.exists() and (not self.out.is_dir() or any(p.name not in _RUN_FILES for p in self.out.iterdir())):
            msg = f"--out {str(self.out)!r} exists and is not a corpus run folder; give a new or empty folder"
            raise InvalidInputError(msg, field="out")
        self.parts.mkdir(parents=True, exist_ok=True)
        self.write_manifest(complete=False)
        return False

    def _drop_unfinished(self) -> None:
        """Remove what a killed run left half-done: temporary files, and parts whose marker was never written."""
        self.parts.mkdir(parents=True, exist_ok=True)
        committed = {marker.name.removesuffix(".done.json") for marker in self._markers()}
        for path in self.parts.iterdir():
            match = _PART.match(path.name)
            if path.name.startswith(".") or (match and path.name.split(".")[0] not in committed):
                path.unlink(missing_ok=True)

    def write_manifest(self, *, complete: bool, counts: dict[str, int] | None = None) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        body = {**self.identity, "complete": complete, **(counts or {})}
        write_atomic(self.out / MANIFEST, json.dumps(body, indent=2))

    def _markers(self) -> list[Path]:
        return sorted(self.parts.glob("part-*.done.json")) if self.parts.is_dir() else []

    def _first_parts(self) -> list[tuple[Path, set[int]]]:
        """Each committed part with the items it is the first to cover (later copies of an item are dropped)."""
        seen: set[int] = set()
        parts: list[tuple[Path, set[int]]] = []
        repeated: set[int] = set()
        for marker in self._markers():
            items = {int(index) for index in read_json(marker)["items"]}
            repeated |= items & seen
            parts.append((marker, items - seen))
            seen |= items
        if repeated:
            shown = ", ".join(map(str, sorted(repeated)[:10]))
            logger.warning("%d item(s) were committed twice in %s (%s); each keeps its first part's rows",
                           len(repeated), self.out, shown)  # fmt: skip
        return parts

    def done(self) -> set[int]:
        """Items some committed part covers (with rows or an error): a rerun skips them."""
        return {index for marker in self._markers() for index in read_json(marker)["items"]}

    def error_count(self) -> int:
        return self.errors().num_rows if self._markers() else 0

    # --- writing -----------------------------------------------------------------------------------------
    def _next_part(self) -> str:
        numbers = [int(m.group(1)) for p in self.parts.iterdir() if (m := _PART.match(p.name))]
        return f"part-{max(numbers, default=-1) + 1:06d}"

    def write_part(self, outcomes: Sequence[ItemOutcome]) -> None:
        """Commit a finished batch: its rows, its errors, then the marker that makes the part count."""
        import pyarrow as pa

        if not outcomes:
            return
        self.parts.mkdir(parents=True, exist_ok=True)
        stem = self._next_part()
        rows = [row for outcome in outcomes for row in outcome.rows]
        errors = [outcome.error_row() for outcome in outcomes if outcome.error is not None]
        write_table(self.parts / f"{stem}.results.parquet", pa.Table.from_pylist(rows, schema=self.schema))
        write_table(self.parts / f"{stem}.errors.parquet", pa.Table.from_pylist(errors, schema=self.error_schema))
        marker = {"items": [outcome.index for outcome in outcomes], "errors": len(errors), "rows": len(rows)}
        write_atomic(self.parts / f"{stem}.done.json", json.dumps(marker))

    # --- reading the whole run ---------------------------------------------------------------------------
    def _gather(self, suffix: str, schema: Any) -> Any:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        tables = []
        for marker, items in self._first_parts():
            table = pq.read_table(marker.with_name(marker.name.replace(".done.json", suffix))).cast(schema)
            tables.append(table.filter(pc.is_in(table["item"], pa.array(sorted(items), pa.int64()))))
        table = pa.concat_tables(tables) if tables else schema.empty_table()
        return table.sort_by([("item", "ascending")]).combine_chunks()  # a stable sort: each item's rows keep order

    def results(self) -> Any:
        """Every committed row, by item."""
        return self._gather(".results.parquet", self.schema)

    def errors(self) -> Any:
        """Every committed error row, by item."""
        return self._gather(".errors.parquet", self.error_schema)

    def write_outputs(self, table: Any, errors: Any, summary: dict[str, Any], page: str) -> None:
        """The final table, errors, summary and page of what is done so far."""
        write_table(self.out / TABLE, table)
        write_table(self.out / ERRORS, errors)
        write_atomic(self.out / SUMMARY, json.dumps(summary, indent=2, allow_nan=False))
        write_atomic(self.out / PAGE, page)


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidInputError(f"{path.name} in {str(path.parent)!r} cannot be read ({exc})") from exc
    if not isinstance(value, dict):
        raise InvalidInputError(f"{path.name} in {str(path.parent)!r} is not a JSON object")
    return value


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def read_run(path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A run folder's manifest and summary (None until the run has written one)."""
    summary = path / SUMMARY
    return read_json(path / MANIFEST), read_json(summary) if summary.is_file() else None
