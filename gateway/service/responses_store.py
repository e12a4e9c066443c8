"""Stored Responses (OpenAI's /v1/responses) in SQLite under the data directory, and the background
responses in flight.

Layout: `<data_dir>/responses.db`, one table `responses`: one row per stored response, holding the
response object and its whole input context (the earlier turns' items and this turn's input), both
as the JSON the routes send. A `previous_response_id` chain is read from one row: the earlier turn's
input context plus its output. So deleting a response never breaks the chains that continue from it.

The gateway's data directory is held by one gateway at a time (`gateway/batch/data_dir.py`'s lock),
so this store never shares its file with another writer. `ResponseStore` is synchronous and used from
one thread at a time: the routes call it through `run()`, on the store's own thread.

Background responses (`background: true`) run as asyncio tasks (`BackgroundResponses`); a gateway
that stops or dies with some still running finds their rows unfinished when it opens the store
again, and marks them failed (`fail_unfinished`): their generations died with the old process.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

from gateway.service.sqlite_store import SQLiteStore

logger = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, status TEXT NOT NULL,
    response TEXT NOT NULL,       -- the response object's JSON
    input_items TEXT NOT NULL);   -- JSON list: the earlier turns' items, then this turn's input items
"""

# Statuses of a response that may still change (OpenAI's words).
UNFINISHED_STATUSES = ("queued", "in_progress")


class ResponseNotFound(LookupError):
    """No stored response with that id (never stored, `store: false`, or deleted)."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One row: `response_json` and `input_items_json` are the JSON texts the routes wrote."""

    id: str
    created_at: int
    status: str
    response_json: str
    input_items_json: str


class ResponseStore(SQLiteStore):
    def __init__(self, data_dir: str | Path) -> None:
        super().__init__(Path(data_dir) / "responses.db", SCHEMA, "responses-store")

    def put(self, record: StoredResponse) -> None:
        """Insert the response, or replace the row of the same id (a background response's updates)."""
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                (record.id, record.created_at, record.status, record.response_json, record.input_items_json),
            )

    def update_unfinished(self, response_id: str, status: str, response_json: str) -> bool:
        """Set the response's status and object only while it is unfinished (a cancel that came first
        wins); False, and nothing changes, if it has finished or is gone."""
        marks = ", ".join("?" * len(UNFINISHED_STATUSES))
        with self._transaction() as db:
            updated = db.execute(
                f"UPDATE responses SET status = ?, response = ? WHERE id = ? AND status IN ({marks})",
                (status, response_json, response_id, *UNFINISHED_STATUSES),
            ).rowcount
        return bool(updated)

    def get(self, response_id: str) -> StoredResponse:
        row = self._db.execute("SELECT * FROM responses WHERE id = ?", (response_id,)).fetchone()
        if row is None:
            raise ResponseNotFound(f"No response found with id '{response_id}'.")
        return StoredResponse(row["id"], row["created_at"], row["status"], row["response"], row["input_items"])

    def delete(self, response_id: str) -> None:
        with self._transaction() as db:
            if db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount == 0:
                raise ResponseNotFound(f"No response found with id '{response_id}'.")

    def unfinished(self) -> list[StoredResponse]:
        """The rows a gateway left queued or in progress (read at start-up, to mark them failed)."""
        marks = ", ".join("?" * len(UNFINISHED_STATUSES))
        rows = self._db.execute(f"SELECT id FROM responses WHERE status IN ({marks})", UNFINISHED_STATUSES)
        return [self.get(r["id"]) for r in rows.fetchall()]


class BackgroundResponses:
    """The background responses running in this gateway, by id: `start` one, `cancel` it (True when it
    was still running), `close` cancels them all (the gateway is stopping)."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}

    def start(self, response_id: str, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks[response_id] = task
        task.add_done_callback(functools.partial(self._finished, response_id))

    async def cancel(self, response_id: str) -> bool:
        task = self._tasks.pop(response_id, None)
        if task is None or task.done():
            return False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # its generation is released before we answer
        return True

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _finished(self, response_id: str, task: asyncio.Task) -> None:
        if self._tasks.get(response_id) is task:
            del self._tasks[response_id]
        if not task.cancelled() and task.exception() is not None:
            logger.error("background response %s failed", response_id, exc_info=task.exception())


@dataclass(frozen=True, slots=True)
class ResponsesService:
    """What the /v1/responses routes share (held on `app.state.responses`)."""

    store: ResponseStore
    background: BackgroundResponses
