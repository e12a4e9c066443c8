"""The batch store's records: statuses, errors, and the frozen values it hands out (files, batches,
lines to run), with the SQLite tables that hold them and the converters from their rows. Plain
values: no SQL runs here."""

from __future__ import annotations

import enum
import json
import sqlite3
from dataclasses import dataclass

from gateway.batch.lines import BatchError

SCHEMA = """
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


def file_record(row: sqlite3.Row) -> FileRecord:
    """A `files` row as its record."""
    return FileRecord(row["id"], row["filename"], row["purpose"], row["num_bytes"], row["created_at"])


def batch_record(row: sqlite3.Row) -> BatchRecord:
    """A `batches` row as its record (`metadata` and `errors` are stored as JSON text)."""
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
