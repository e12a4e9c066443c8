"""Admission: what does not fit waits in arrival order; only a full queue or an expired wait is
refused, with Retry-After; other errors pass through at once."""

from __future__ import annotations

import asyncio

import pytest

from gateway.cluster.admission import Admission
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics


class _Pool:
    """Decode pages as a counter: `reserve` takes one or fails as a full worker would."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.calls = 0

    async def reserve(self, name: str, order: list[str]) -> str:
        self.calls += 1
        if self.free == 0:
            raise APIError(503, "need 1 KV pages, 0 free", "server_overloaded", code="capacity_exceeded")
        self.free -= 1
        order.append(name)
        return name


def test_waiters_are_admitted_in_arrival_order_as_pages_come_back() -> None:
    async def main() -> None:
        admission, pool, order = Admission(8, 30.0, GatewayMetrics()), _Pool(free=1), []
        first = await admission.admit(lambda: pool.reserve("first", order))
        waiters = []
        for name in ("a", "b", "c"):
            waiters.append(asyncio.create_task(admission.admit(lambda n=name: pool.reserve(n, order))))
            await asyncio.sleep(0.01)
        assert admission.num_queued == 3 and order == ["first"]
        late = asyncio.create_task(admission.admit(lambda: pool.reserve("late", order)))   # must not jump the queue
        for _ in range(4):
            pool.free += 1
            admission.released()
            await asyncio.sleep(0.05)
        assert first == "first" and order == ["first", "a", "b", "c", "late"]
        assert [await w for w in waiters] == ["a", "b", "c"] and await late == "late"
        assert admission.num_queued == 0

    asyncio.run(main())


def test_a_full_queue_and_an_expired_wait_are_503s_with_retry_after() -> None:
    async def main() -> None:
        metrics = GatewayMetrics()
        admission, pool, order = Admission(1, 0.3, metrics), _Pool(free=0), []
        waiting = asyncio.create_task(admission.admit(lambda: pool.reserve("w", order)))
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as full:
            await admission.admit(lambda: pool.reserve("x", order))
        assert (full.value.status, full.value.code, full.value.headers) == (503, "queue_full", {"Retry-After": "1"})
        with pytest.raises(APIError) as expired:
            await waiting
        assert expired.value.status == 503 and expired.value.code == "queue_timeout"
        assert int(expired.value.headers["Retry-After"]) >= 1
        assert pool.calls >= 3   # the head retried on the interval, with no release seen
        assert admission.num_queued == 0 and order == []

    asyncio.run(main())


def test_other_errors_are_not_queued() -> None:
    async def main() -> None:
        admission = Admission(8, 30.0, GatewayMetrics())

        async def refused() -> None:
            raise APIError(400, "prompt too long", code="context_length_exceeded")
        with pytest.raises(APIError) as error:
            await admission.admit(refused)
        assert error.value.status == 400 and admission.num_queued == 0

    asyncio.run(main())


async def _queue(admission: Admission, pool: _Pool, order: list[str], *waiters: tuple[str, int, str]) -> list:
    """Queue each (name, priority, tenant) in this order, behind a full pool."""
    tasks = []
    for name, priority, tenant in waiters:
        tasks.append(asyncio.create_task(admission.admit(lambda n=name: pool.reserve(n, order), priority, tenant)))
        await asyncio.sleep(0.01)
    return tasks


async def _release_one_at_a_time(admission: Admission, pool: _Pool, times: int) -> None:
    for _ in range(times):
        pool.free += 1
        admission.released()
        await asyncio.sleep(0.05)


def test_waiters_are_admitted_by_priority_lower_first_then_in_arrival_order() -> None:
    async def main() -> None:
        admission, pool, order = Admission(8, 30.0, GatewayMetrics()), _Pool(free=0), []
        tasks = await _queue(admission, pool, order, ("a", 0, ""), ("batch", 5, ""), ("b", 0, ""), ("urgent", -1, ""))
        await _release_one_at_a_time(admission, pool, 4)
        assert order == ["urgent", "a", "b", "batch"]
        assert [await t for t in tasks] == ["a", "batch", "b", "urgent"] and admission.num_queued == 0

    asyncio.run(main())


def test_tenants_of_one_priority_take_turns_and_one_that_was_away_gets_no_credit() -> None:
    async def main() -> None:
        admission, pool, order = Admission(16, 30.0, GatewayMetrics()), _Pool(free=0), []
        flood = await _queue(admission, pool, order, *((f"a{i}", 0, "A") for i in range(1, 5)))
        few = await _queue(admission, pool, order, ("b1", 0, "B"), ("b2", 0, "B"), ("u1", -1, "A"))
        await _release_one_at_a_time(admission, pool, 5)
        assert order == ["u1", "a1", "b1", "a2", "b2"]   # the better priority first, then turns
        late = await _queue(admission, pool, order, ("c1", 0, "C"), ("c2", 0, "C"))
        await _release_one_at_a_time(admission, pool, 4)
        # C's first turn comes after A's pending a3 (same turn, earlier), not before all of A's
        assert order[5:] == ["a3", "c1", "a4", "c2"]
        assert len([await t for t in flood + few + late]) == 9 and admission.num_queued == 0

    asyncio.run(main())


def test_a_better_priority_takes_the_place_of_the_least_preferred_waiter_in_a_full_queue() -> None:
    async def main() -> None:
        admission, pool, order = Admission(2, 30.0, GatewayMetrics()), _Pool(free=0), []
        low_old, low_new = await _queue(admission, pool, order, ("low-old", 5, ""), ("low-new", 5, ""))
        with pytest.raises(APIError) as same:   # no better than the worst waiter: refused
            await admission.admit(lambda: pool.reserve("same", order), 5, "")
        assert same.value.code == "queue_full"
        [urgent] = await _queue(admission, pool, order, ("urgent", 0, ""))
        with pytest.raises(APIError) as evicted:   # the worst priority, then the newest, made room
            await low_new
        assert (evicted.value.status, evicted.value.code) == (503, "queue_full") and admission.num_queued == 2
        await _release_one_at_a_time(admission, pool, 2)
        assert order == ["urgent", "low-old"] and await urgent == "urgent" and await low_old == "low-old"
        assert admission.num_queued == 0

    asyncio.run(main())
