"""The base of the gateway's stores (batches and files, stored responses): one SQLite database in WAL
mode with full sync, owned by one thread. A store's methods are synchronous; the event loop calls them
through `run`, which runs each on the store's own thread in the order the calls were made, so the loop
never waits on SQLite or fsync. `_transaction` wraps writes in BEGIN IMMEDIATE ... COMMIT."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sqlite3
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class SQLiteStore:
    def __init__(self, path: Path, schema: str, thread_name: str) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(schema)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=thread_name)

    async def run(self, method: Callable[..., T], *args) -> T:
        """Run `method(*args)` (a method of this store) on the store's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(method, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
