"""The gRPC calls in flight, by the id their answers carry, so that an Abort from another call can
end one. Event loop only."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from gateway.errors import APIError


class Calls:
    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()

    @contextlib.contextmanager
    def registered(self, call_id: str, param: str) -> Iterator[None]:
        """The current task as the call `call_id` while the block runs; an id already in flight is
        refused (409, ALREADY_EXISTS), naming the request's id field `param`."""
        if call_id in self._tasks:
            raise APIError(409, f"a request with id {call_id!r} is already in flight", param=param)
        task = asyncio.current_task()
        assert task is not None, "a gRPC call runs in a task"
        self._tasks[call_id] = task
        try:
            yield
        finally:
            del self._tasks[call_id]
            self._aborted.discard(call_id)

    def abort(self, call_id: str) -> bool:
        """Cancel the call `call_id` (which ends with CANCELLED); False when none is in flight."""
        task = self._tasks.get(call_id)
        if task is None:
            return False
        self._aborted.add(call_id)
        task.cancel()
        return True

    def was_aborted(self, call_id: str) -> bool:
        return call_id in self._aborted
