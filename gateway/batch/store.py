"""Files and batches on disk: one SQLite database (WAL) plus file contents, under the data directory.

Layout: `<data_dir>/tandem.db` (tables `files`, `batches`, `batch_lines`: `records.SCHEMA`), plus
what `data_dir.py` keeps there: `files/<file id>` (contents) and `lock`. This module runs the SQL.

Crash safety, for a kill -9 at any point:
- A line's answer and its "done" mark are one row update (`batch_lines.result`), made in the same
  transaction as the batch's counters, and only when the row has no answer yet. So a line is
  either answered and counted once, or not answered and run again after a restart; never twice.
- File contents are made durable before the row naming them is committed (`DataDir.write_contents`);
  a row is deleted before its contents. Contents with no row (a crash in between) are removed when
  the store opens.
- Finalizing writes the output and error files, then in one transaction adds their rows, sets
  the batch's final status and drops its lines. A crash before that commit leaves the batch
  finalizing (or cancelling) with its lines intact, and it is finalized again.

`BatchStore` is synchronous and must be used from one thread at a time: the gateway calls it
through `run()`, which runs every call on the store's own thread, so the event loop never waits
on SQLite or fsync and calls are applied in the order they were made.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from gateway.batch.data_dir import DataDir
from gateway.batch.lines import BatchError, InputLine, error_line
from gateway.batch.records import (
    SCHEMA,
    BatchRecord,
    BatchStatus,
    ConflictError,
    FileRecord,
    NotFoundError,
    PendingLine,
    batch_record,
    file_record,
)
from gateway.service.sqlite_store import SQLiteStore

COMPLETION_WINDOW_S = {"24h": 24 * 3600}

_UNFINISHED = tuple(s.value for s in BatchStatus if not s.is_finished)


class BatchStore(SQLiteStore):
    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self._dir = DataDir(self.data_dir)
        self.files_dir = self._dir.files_dir
        super().__init__(self.data_dir / "tandem.db", SCHEMA, "batch-store")
        self._dir.remove_orphans({r["id"] for r in self._db.execute("SELECT id FROM files")})

    def close(self) -> None:
        super().close()
        self._dir.close()

    # files

    def add_file(self, source: BinaryIO, filename: str, purpose: str) -> FileRecord:
        file_id = f"file-{uuid.uuid4().hex}"
        num_bytes = self._dir.write_stream(file_id, source)
        record = FileRecord(file_id, filename, purpose, num_bytes, int(time.time()))
        with self._transaction() as db:
            _insert_file(db, record)
        return record

    def get_file(self, file_id: str) -> FileRecord:
        row = self._db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"No such file: {file_id}")
        return file_record(row)

    def file_path(self, file_id: str) -> Path:
        """Where a file's contents are; check the file exists with `get_file` first."""
        return self._dir.file_path(file_id)

    def list_files(
        self, purpose: str | None = None, after: str | None = None, limit: int = 10_000, order: str = "desc"
    ) -> tuple[list[FileRecord], bool]:
        """Files newest first (`order="asc"`: oldest first), after the file `after`; and whether more follow."""
        rows = self._page(
            "files", after, limit, order, "purpose = ?" if purpose else None, (purpose,) if purpose else ()
        )
        return [file_record(r) for r in rows[:limit]], len(rows) > limit

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
        status, expires_at = BatchStatus.VALIDATING.value, now + COMPLETION_WINDOW_S[completion_window]
        metadata_json = json.dumps(metadata) if metadata is not None else None
        with self._transaction() as db:
            db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, "
                "expires_at, metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, endpoint, input_file_id, completion_window, status, now, expires_at, metadata_json),
            )
        return self.get_batch(batch_id)

    def get_batch(self, batch_id: str) -> BatchRecord:
        row = self._db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"No such batch: {batch_id}")
        return batch_record(row)

    def list_batches(self, after: str | None = None, limit: int = 20) -> tuple[list[BatchRecord], bool]:
        rows = self._page("batches", after, limit, "desc", None, ())
        return [batch_record(r) for r in rows[:limit]], len(rows) > limit

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
        status, ended_at = ("cancelled", "cancelled_at") if is_cancel else ("completed", "completed_at")
        output_id, errors_id = (output.id if output else None), (errors.id if errors else None)
        now = int(time.time())
        with self._transaction() as db:
            for record in (output, errors):
                if record is not None:
                    _insert_file(db, record)
            db.execute(
                f"UPDATE batches SET status = ?, {ended_at} = ?, output_file_id = ?, error_file_id = ? WHERE id = ?",
                (status, now, output_id, errors_id, batch_id),
            )
            db.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
        return self.get_batch(batch_id)

    # internals

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
        chunks = ((r["result"] + "\n").encode() for r in itertools.chain((first,), rows))
        num_bytes = self._dir.write_contents(file_id, chunks)
        return FileRecord(file_id, filename, "batch_output", num_bytes, int(time.time()))


def _insert_file(db: sqlite3.Connection, record: FileRecord) -> None:
    db.execute(
        "INSERT INTO files VALUES (?, ?, ?, ?, ?)",
        (record.id, record.filename, record.purpose, record.num_bytes, record.created_at),
    )
