"""Admission: a trip whose decode reservation does not fit now waits its turn instead of being refused.

Trips reserve decode pages before anything else (`gateway/cluster/handoff.py`). When the decode workers
answer that the pages are not free now (`capacity_exceeded`), the trip joins one queue; only its
head retries, each time a trip of this gateway ends (its pages are back) and at least every
`_RETRY_INTERVAL_S` (pages also come back by expiry, or through other gateways). A new trip goes
straight to the workers only while nobody waits. Refused are only a trip that finds `max_queued`
trips waiting, and one that waited `max_wait_s`: both 503 `server_overloaded` with `Retry-After`. A
trip that finds the queue full but ranks better than its least preferred waiter (the worst priority,
then the newest) takes that waiter's place, and the waiter gets the full queue's 503.

The head is the waiter of the best priority (the lowest value, vLLM's convention); within a
priority, the tenants take turns: start-time fair queuing with one unit per request, so each
waiter's tag is one past its tenant's previous tag in that priority, or past the tag last admitted
there if the tenant has fallen behind (a tenant that was away gets no credit for it), and the
lowest tag goes first, then the earliest arrival. A tenant with many waiters thus gets no more
turns than one with few while both wait. Event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from gateway.errors import APIError
from gateway.metrics import GatewayMetrics

T = TypeVar("T")

_RETRY_INTERVAL_S = 0.1
_CAPACITY_CODE = "capacity_exceeded"


@dataclass(slots=True)
class _Waiter:
    """One waiting trip; `turn` is set when it becomes the head."""

    priority: int
    tag: int  # its tenant's turn within its priority (see the module's docstring)
    seq: int  # arrival order
    tenant: str
    turn: asyncio.Event = field(default_factory=asyncio.Event)
    is_evicted: bool = False  # a better-ranked trip took its place in a full queue

    @property
    def rank(self) -> tuple[int, int, int]:
        return (self.priority, self.tag, self.seq)


class Admission:
    def __init__(self, max_queued: int, max_wait_s: float, metrics: GatewayMetrics | None = None) -> None:
        if max_queued < 0 or max_wait_s <= 0:
            raise ValueError("max_queued must be >= 0 and max_wait_s positive")
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self._metrics = metrics or GatewayMetrics()  # a pool built without an app keeps its own
        self._queue: list[_Waiter] = []
        self._released = asyncio.Event()
        self._arrivals = itertools.count()
        self._last_tags: dict[tuple[int, str], int] = {}  # (priority, tenant) -> its newest waiter's tag
        self._admitted_tags: dict[int, int] = {}  # priority -> the tag of the waiter admitted last there

    @property
    def num_queued(self) -> int:
        return sum(not w.is_evicted for w in self._queue)

    def _head(self) -> _Waiter:
        return min((w for w in self._queue if not w.is_evicted), key=lambda w: w.rank)

    def _join(self, priority: int, tenant: str) -> _Waiter:
        """Queue a waiter, tagged for its tenant's turn in its priority."""
        key = (priority, tenant)
        tag = max(self._last_tags.get(key, 0), self._admitted_tags.get(priority, 0)) + 1
        self._last_tags[key] = tag
        waiter = _Waiter(priority, tag, next(self._arrivals), tenant)
        self._queue.append(waiter)
        return waiter

    def _leave(self, waiter: _Waiter, is_admitted: bool) -> None:
        """Take `waiter` off the queue; wake the new head, which may fit too."""
        self._queue.remove(waiter)
        if is_admitted:
            done = self._admitted_tags.get(waiter.priority, 0)
            self._admitted_tags[waiter.priority] = max(done, waiter.tag)
        if not self.num_queued:  # every tag is behind; forget them all (evicted waiters are on their way out)
            self._last_tags.clear()
            self._admitted_tags.clear()
            return
        if len(self._last_tags) > 2 * len(self._queue) + 64:  # a tag behind its priority's is as good as none
            behind = [k for k, tag in self._last_tags.items() if tag <= self._admitted_tags.get(k[0], 0)]
            for key in behind:
                del self._last_tags[key]
        self._head().turn.set()

    def released(self) -> None:
        """A trip ended and gave its pages back: the head of the queue tries again now."""
        self._released.set()

    async def admit(self, reserve: Callable[[], Awaitable[T]], priority: int = 0, tenant: str = "") -> T:
        """`reserve()`'s result, calling it again while it fails for lack of free pages, in the turn
        of `priority` (lower goes first) and `tenant`; raises the 503 of a full queue or an expired
        wait, or `reserve`'s own errors."""
        if not self.num_queued:
            try:
                return await reserve()
            except APIError as exc:
                if exc.code != _CAPACITY_CODE:
                    raise
        if self.num_queued >= self.max_queued:
            self._make_room(priority)
        waiter = self._join(priority, tenant)
        self._metrics.queued_requests.set(self.num_queued)
        started = time.monotonic()
        is_admitted = False
        try:
            result = await self._wait_and_reserve(waiter, started + self.max_wait_s, reserve)
            is_admitted = True
            return result
        finally:
            self._leave(waiter, is_admitted)
            self._metrics.queued_requests.set(self.num_queued)
            self._metrics.queue_wait.observe(time.monotonic() - started)

    def _make_room(self, priority: int) -> None:
        """The queue is full: evict its least preferred waiter if it ranks below `priority`, else
        raise the full queue's 503."""
        waiting = [w for w in self._queue if not w.is_evicted]
        worst = max(waiting, key=lambda w: (w.priority, w.seq), default=None)
        if worst is None or worst.priority <= priority:
            raise self._queue_full()
        worst.is_evicted = True
        worst.turn.set()  # it wakes, sees it was evicted and leaves with the 503

    def _queue_full(self) -> APIError:
        self._metrics.admission_refused.labels("queue_full").inc()
        return APIError(
            503,
            f"the server is overloaded: {self.num_queued} requests are already waiting for KV cache space",
            "server_overloaded",
            code="queue_full",
            retry_after_s=1,
        )

    async def _wait_and_reserve(self, waiter: _Waiter, deadline: float, reserve: Callable[[], Awaitable[T]]) -> T:
        while True:
            if waiter.is_evicted:
                raise self._queue_full()
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
            if self._head() is not waiter:
                waiter.turn.clear()
                await _wait(waiter.turn, remaining)  # set when this trip becomes the head
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
