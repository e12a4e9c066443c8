"""Admission: a trip whose decode reservation does not fit now waits its turn instead of being refused.

Trips reserve decode pages before anything else (`gateway/cluster/handoff.py`). When the decode workers
answer that the pages are not free now (`capacity_exceeded`), the trip joins one FIFO queue; only
its head retries, each time a trip of this gateway ends (its pages are back) and at least every
`_RETRY_INTERVAL_S` (pages also come back by expiry, or through other gateways). A new trip goes
straight to the workers only while nobody waits, so the order is fair. Refused are only a trip
that finds `max_queued` trips waiting, and one that waited `max_wait_s`: both 503
`server_overloaded` with `Retry-After`. Event loop only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gateway.errors import APIError
from gateway.metrics import GatewayMetrics

T = TypeVar("T")

_RETRY_INTERVAL_S = 0.1
_CAPACITY_CODE = "capacity_exceeded"


class Admission:
    def __init__(self, max_queued: int, max_wait_s: float, metrics: GatewayMetrics | None = None) -> None:
        if max_queued < 0 or max_wait_s <= 0:
            raise ValueError("max_queued must be >= 0 and max_wait_s positive")
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self._metrics = metrics or GatewayMetrics()  # a pool built without an app keeps its own
        self._queue: collections.deque[asyncio.Event] = collections.deque()  # one per waiting trip: "your turn"
        self._released = asyncio.Event()

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def released(self) -> None:
        """A trip ended and gave its pages back: the head of the queue tries again now."""
        self._released.set()

    async def admit(self, reserve: Callable[[], Awaitable[T]]) -> T:
        """`reserve()`'s result, calling it again while it fails for lack of free pages; raises the
        503 of a full queue or an expired wait, or `reserve`'s own errors."""
        if not self._queue:
            try:
                return await reserve()
            except APIError as exc:
                if exc.code != _CAPACITY_CODE:
                    raise
        if len(self._queue) >= self.max_queued:
            self._metrics.admission_refused.labels("queue_full").inc()
            raise APIError(
                503,
                f"the server is overloaded: {len(self._queue)} requests are already waiting for KV cache space",
                "server_overloaded",
                code="queue_full",
                retry_after_s=1,
            )
        turn = asyncio.Event()
        self._queue.append(turn)
        self._metrics.queued_requests.set(len(self._queue))
        started = time.monotonic()
        try:
            return await self._wait_and_reserve(turn, started + self.max_wait_s, reserve)
        finally:
            was_head = self._queue[0] is turn
            self._queue.remove(turn)
            self._metrics.queued_requests.set(len(self._queue))
            self._metrics.queue_wait.observe(time.monotonic() - started)
            if was_head and self._queue:
                self._queue[0].set()  # the next one may fit too

    async def _wait_and_reserve(self, turn: asyncio.Event, deadline: float, reserve: Callable[[], Awaitable[T]]) -> T:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._metrics.admission_refused.labels("queue_timeout").inc()
                raise APIError(
                    503,
                    f"the server is overloaded: no KV cache space freed up within {self.max_wait_s:g} s",
                    "server_overloaded",
                    code="queue_timeout",
                    retry_after_s=max(1, math.ceil(self.max_wait_s / 4)),
                )
            if self._queue[0] is not turn:
                await _wait(turn, remaining)  # set when this trip becomes the head
                continue
            self._released.clear()  # before the try: a release during it is not missed
            try:
                return await reserve()
            except APIError as exc:
                if exc.code != _CAPACITY_CODE:
                    raise
            await _wait(self._released, min(_RETRY_INTERVAL_S, remaining))


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether `event` was set within `timeout_s`."""
    if timeout_s <= 0:
        return event.is_set()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
    return event.is_set()
