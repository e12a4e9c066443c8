"""Files and batches on disk: one SQLite database (WAL) plus file contents, under the data directory.

Layout: `<data_dir>/tandem.db` (tables `files`, `batches`, `batch_lines`), `<data_dir>/files/<file id>`
(contents), `<data_dir>/lock` (held with flock by the one gateway using the directory).

Crash safety, for a kill -9 at any point:
- A line's answer and its "done" mark are one row update (`batch_lines.result`), made in the same
  transaction as the batch's counters, and only when the row has no answer yet. So a line is
  either answered and counted once, or not answered and run again after a restart; never twice.
- File contents are written to `<id>.part`, fsynced and renamed before the row naming them is
  committed; a row is deleted before its contents. Contents with no row (a crash in between) are
  removed when the store opens.
- Finalizing writes the output and error files, then in one transaction adds their rows, sets
  the batch's final status and drops its lines. A crash before that commit leaves the batch
  finalizing (or cancelling) with its lines intact, and it is finalized again.

`BatchStore` is synchronous and must be used from one thread at a time: the gateway calls it
through `run()`, which runs every call on the store's own thread, so the event loop never waits
on SQLite or fsync and calls are applied in the order they were made.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import fcntl
import functools
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from gateway.batch.lines import BatchError, InputLine, error_line

T = TypeVar("T")
COMPLETION_WINDOW_S = {"24h": 24 * 3600}
_CHUNK_BYTES = 1 << 20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, num_bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER, output_file_id TEXT, error_file_id TEXT,
    num_total INTEGER NOT NULL DEFAULT 0, num_completed INTEGER NOT NULL DEFAULT 0,
    num_failed INTEGER NOT NULL DEFAULT 0, metadata TEXT, errors TEXT);
-- One row per non-blank input line, from validation until the batch is finalized.
-- request: the body to run (NULL for a line that cannot run); result: the output or error line.
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, line_index INTEGER NOT NULL, custom_id TEXT, request TEXT, result TEXT,
    is_error INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, line_index)) WITHOUT ROWID;
"""


class BatchStatus(enum.Enum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_finished(self) -> bool:
        return self in (BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


_UNFINISHED = tuple(s.value for s in BatchStatus if not s.is_finished)


class NotFoundError(LookupError):
    """No file or batch with that id."""


class ConflictError(Exception):
    """The batch is in a status that does not allow the operation."""


class DataDirInUseError(RuntimeError):
    """Another process holds the data directory's lock."""


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    filename: str
    purpose: str
    num_bytes: int
    created_at: int


@dataclass(frozen=True, slots=True)
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    output_file_id: str | None
    error_file_id: str | None
    num_total: int
    num_completed: int
    num_failed: int
    metadata: dict[str, str] | None
    errors: tuple[BatchError, ...]


@dataclass(frozen=True, slots=True)
class PendingLine:
    line_index: int
    custom_id: str
    body: str  # JSON text


class BatchStore:
    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self.files_dir = self.data_dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock(self.data_dir / "lock")
        self._db = sqlite3.connect(self.data_dir / "tandem.db", isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._remove_orphan_contents()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="batch-store")

    async def run(self, method: Callable[..., T], *args) -> T:
        """Run `method(*args)` (a method of this store) on the store's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(method, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._db.close()
        os.close(self._lock_fd)

    # files

    def add_file(self, source: BinaryIO, filename: str, purpose: str) -> FileRecord:
        file_id = f"file-{uuid.uuid4().hex}"
        num_bytes = self._write_contents(file_id, iter(functools.partial(source.read, _CHUNK_BYTES), b""))
        record = FileRecord(file_id, filename, purpose, num_bytes, int(time.time()))
        with self._transaction() as db:
            _insert_file(db, record)
        return record

    def get_file(self, file_id: str) -> FileRecord:
        row = self._db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"No such file: {file_id}")
        return _file_record(row)

    def file_path(self, file_id: str) -> Path:
        """Where a file's contents are; check the file exists with `get_file` first."""
        return self.files_dir / file_id

    def list_files(
        self, purpose: str | None = None, after: str | None = None, limit: int = 10_000, order: str = "desc"
    ) -> tuple[list[FileRecord], bool]:
        """Files newest first (`order="asc"`: oldest first), after the file `after`; and whether more follow."""
        rows = self._page(
            "files", after, limit, order, "purpose = ?" if purpose else None, (purpose,) if purpose else ()
        )
        return [_file_record(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> None:
        with self._transaction() as db:
            if db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount == 0:
                raise NotFoundError(f"No such file: {file_id}")
        self.file_path(file_id).unlink(missing_ok=True)

    # batches

    def create_batch(
        self, endpoint: str, input_file_id: str, completion_window: str, metadata: dict[str, str] | None = None
    ) -> BatchRecord:
        batch_id, now = f"batch_{uuid.uuid4().hex}", int(time.time())
        with self._transaction() as db:
            db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, "
                "expires_at, metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    batch_id,
                    endpoint,
                    input_file_id,
                    completion_window,
                    BatchStatus.VALIDATING.value,
                    now,
                    now + COMPLETION_WINDOW_S[completion_window],
                    json.dumps(metadata) if metadata is not None else None,
                ),
            )
        return self.get_batch(batch_id)

    def get_batch(self, batch_id: str) -> BatchRecord:
        row = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"No such batch: {batch_id}")
        return _batch_record(row)

    def list_batches(self, after: str | None = None, limit: int = 20) -> tuple[list[BatchRecord], bool]:
        rows = self._page("batches", after, limit, "desc", None, ())
        return [_batch_record(r) for r in rows[:limit]], len(rows) > limit

    def unfinished_batch_ids(self) -> list[str]:
        marks = ", ".join("?" * len(_UNFINISHED))
        rows = self._db.execute(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY rowid", _UNFINISHED)
        return [r["id"] for r in rows]

    def request_cancel(self, batch_id: str) -> BatchRecord:
        """validating/in_progress -> cancelling; a batch already cancelling is returned as it is."""
        with self._transaction() as db:
            db.execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? "
                "AND status IN ('validating', 'in_progress')",
                (int(time.time()), batch_id),
            )
        batch = self.get_batch(batch_id)
        if batch.status is not BatchStatus.CANCELLING:
            raise ConflictError(f"Cannot cancel batch {batch_id}: its status is {batch.status.value}")
        return batch

    def start_batch(self, batch_id: str, lines: Sequence[InputLine]) -> BatchRecord:
        """Store a validated batch's lines (those that cannot run already answered with their error)
        and move it from validating to in_progress. A no-op for a batch already started."""
        with self._transaction() as db:
            row = db.execute("SELECT status, in_progress_at FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is not None and row["in_progress_at"] is None and row["status"] in ("validating", "cancelling"):
                db.executemany(
                    "INSERT INTO batch_lines VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        (
                            batch_id,
                            ln.line_index,
                            ln.custom_id,
                            ln.body,
                            error_line(ln.custom_id, ln.error) if ln.error else None,
                            int(ln.error is not None),
                        )
                        for ln in lines
                    ),
                )
                db.execute(
                    "UPDATE batches SET num_total = ?, num_failed = ?, in_progress_at = ?, status = CASE "
                    "status WHEN 'validating' THEN 'in_progress' ELSE status END WHERE id = ?",
                    (len(lines), sum(ln.error is not None for ln in lines), int(time.time()), batch_id),
                )
        return self.get_batch(batch_id)

    def fail_batch(self, batch_id: str, errors: Sequence[BatchError]) -> BatchRecord:
        with self._transaction() as db:
            db.execute(
                "UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ?",
                (int(time.time()), json.dumps([e.to_dict() for e in errors]), batch_id),
            )
        return self.get_batch(batch_id)

    def pending_lines(self, batch_id: str, after_index: int = -1, limit: int = 64) -> list[PendingLine]:
        """Unanswered lines that can run, in file order, after `after_index`."""
        rows = self._db.execute(
            "SELECT line_index, custom_id, request FROM batch_lines WHERE batch_id = ? AND result IS NULL "
            "AND request IS NOT NULL AND line_index > ? ORDER BY line_index LIMIT ?",
            (batch_id, after_index, limit),
        )
        return [PendingLine(r["line_index"], r["custom_id"], r["request"]) for r in rows]

    def record_result(self, batch_id: str, line_index: int, result: str, is_error: bool) -> bool:
        """Answer one line and count it, atomically; False (and nothing changes) if it was already answered."""
        with self._transaction() as db:
            updated = db.execute(
                "UPDATE batch_lines SET result = ?, is_error = ? WHERE batch_id = ? "
                "AND line_index = ? AND result IS NULL",
                (result, int(is_error), batch_id, line_index),
            ).rowcount
            if updated:
                db.execute(
                    "UPDATE batches SET num_completed = num_completed + ?, num_failed = num_failed + ? WHERE id = ?",
                    (int(not is_error), int(is_error), batch_id),
                )
        return bool(updated)

    def finalize(self, batch_id: str) -> BatchRecord:
        """Write the output and error files and end the batch: in_progress/finalizing -> completed,
        cancelling -> cancelled (lines never answered are in neither file). Finished batches are returned as
        they are."""
        batch = self.get_batch(batch_id)
        if batch.status.is_finished or batch.status is BatchStatus.VALIDATING:
            return batch
        if batch.status is BatchStatus.IN_PROGRESS:
            with self._transaction() as db:
                db.execute(
                    "UPDATE batches SET status = 'finalizing', finalizing_at = ? WHERE id = ?",
                    (int(time.time()), batch_id),
                )
        is_cancel = batch.status is BatchStatus.CANCELLING
        output = self._write_results(batch_id, False, f"{batch_id}_output.jsonl")
        errors = self._write_results(batch_id, True, f"{batch_id}_error.jsonl")
        now = int(time.time())
        with self._transaction() as db:
            for record in (output, errors):
                if record is not None:
                    _insert_file(db, record)
            db.execute(
                f"UPDATE batches SET status = ?, {'cancelled_at' if is_cancel else 'completed_at'} = ?, "
                "output_file_id = ?, error_file_id = ? WHERE id = ?",
                (
                    "cancelled" if is_cancel else "completed",
                    now,
                    output.id if output else None,
                    errors.id if errors else None,
                    batch_id,
                ),
            )
            db.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
        return self.get_batch(batch_id)

    # internals

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _page(
        self, table: str, after: str | None, limit: int, order: str, where: str | None, args: tuple
    ) -> list[sqlite3.Row]:
        """Up to `limit + 1` rows in insertion order (`desc`: newest first) after the row with id `after`."""
        if order not in ("asc", "desc"):
            raise ValueError(f"order must be asc or desc, got {order!r}")
        clauses, params = ([where], list(args)) if where else ([], [])
        if after is not None:
            anchor = self._db.execute(f"SELECT rowid FROM {table} WHERE id = ?", (after,)).fetchone()
            if anchor is None:
                raise NotFoundError(f"No such {table[:-1]}: {after}")
            clauses.append("rowid < ?" if order == "desc" else "rowid > ?")
            params.append(anchor[0])
        sql = f"SELECT * FROM {table}" + (f" WHERE {' AND '.join(clauses)}" if clauses else "")
        return self._db.execute(f"{sql} ORDER BY rowid {order.upper()} LIMIT ?", (*params, limit + 1)).fetchall()

    def _write_results(self, batch_id: str, is_error: bool, filename: str) -> FileRecord | None:
        """Write the batch's answered lines of one kind, in input order, to a new file (no row yet)."""
        rows = self._db.execute(
            "SELECT result FROM batch_lines WHERE batch_id = ? AND is_error = ? "
            "AND result IS NOT NULL ORDER BY line_index",
            (batch_id, int(is_error)),
        )
        first = rows.fetchone()
        if first is None:
            return None
        file_id = f"file-{uuid.uuid4().hex}"
        chunks = ((r["result"] + "\n").encode() for r in _chain_first(first, rows))
        num_bytes = self._write_contents(file_id, chunks)
        return FileRecord(file_id, filename, "batch_output", num_bytes, int(time.time()))

    def _write_contents(self, file_id: str, chunks: Iterable[bytes]) -> int:
        final, partial = self.file_path(file_id), self.files_dir / f"{file_id}.part"
        num_bytes = 0
        with open(partial, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                num_bytes += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, final)
        _fsync_dir(self.files_dir)
        return num_bytes

    def _remove_orphan_contents(self) -> None:
        known = {r["id"] for r in self._db.execute("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink()


def _chain_first(first: sqlite3.Row, rest: Iterable[sqlite3.Row]) -> Iterator[sqlite3.Row]:
    yield first
    yield from rest


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUseError(
            f"data directory {path.parent} is in use by another gateway (pid {holder}); "
            "give each gateway its own --data-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _insert_file(db: sqlite3.Connection, record: FileRecord) -> None:
    db.execute(
        "INSERT INTO files VALUES (?, ?, ?, ?, ?)",
        (record.id, record.filename, record.purpose, record.num_bytes, record.created_at),
    )


def _file_record(row: sqlite3.Row) -> FileRecord:
    return FileRecord(row["id"], row["filename"], row["purpose"], row["num_bytes"], row["created_at"])


def _batch_record(row: sqlite3.Row) -> BatchRecord:
    errors = tuple(BatchError(**e) for e in json.loads(row["errors"])) if row["errors"] else ()
    return BatchRecord(
        id=row["id"],
        endpoint=row["endpoint"],
        input_file_id=row["input_file_id"],
        completion_window=row["completion_window"],
        status=BatchStatus(row["status"]),
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        in_progress_at=row["in_progress_at"],
        finalizing_at=row["finalizing_at"],
        completed_at=row["completed_at"],
        failed_at=row["failed_at"],
        cancelling_at=row["cancelling_at"],
        cancelled_at=row["cancelled_at"],
        output_file_id=row["output_file_id"],
        error_file_id=row["error_file_id"],
        num_total=row["num_total"],
        num_completed=row["num_completed"],
        num_failed=row["num_failed"],
        metadata=json.loads(row["metadata"]) if row["metadata"] else None,
        errors=errors,
    )
