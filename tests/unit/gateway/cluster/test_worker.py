"""A worker that fails calls: unready at once (the next probe may bring it back), skipped for a growing
while after several failures in a row even if it answers probes, and back in once the while is over and
a probe finds it serving; one success clears the count, and the calls that fail together while it is
down are one failure. Its load counts this gateway's requests exactly
and others' from its last report."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.cluster import worker as worker_module
from gateway.cluster.worker import Worker
from gateway.cluster.worker_errors import WorkerError, worker_error
from gateway.cluster.worker_records import WorkerLoad
from gateway.records import Role
from tests.unit.gateway.cluster.fake_worker import serve_fake_worker


class _Unavailable(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "connection reset")


def _failure() -> WorkerError:
    return worker_error(_Unavailable(), Role.PREFILL, "127.0.0.1:1")


def test_a_worker_that_keeps_failing_is_skipped_a_while_then_probed_back_in(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(worker_module.time, "monotonic", lambda: now[0])

    async def main() -> None:
        async with serve_fake_worker() as fake:
            worker = Worker(Role.PREFILL, fake.address)
            try:
                assert await worker.probe() and worker.is_routable
                worker.record_failure(_failure())
                assert not worker.is_ready                            # no new request until a probe
                assert await worker.probe() and worker.is_routable    # one failure: back at the next probe
                worker.record_failure(_failure())
                worker.record_failure(_failure())                     # failed together while down: one
                assert await worker.probe() and worker.is_routable
                worker.record_failure(_failure())                     # the third in a row: skipped 1 s
                assert await worker.probe() and not worker.is_routable
                now[0] += 1.5
                assert worker.is_routable                             # the while is over, and it serves
                worker.record_failure(_failure())                     # the fourth: 2 s
                await worker.probe()
                now[0] += 1.5
                assert not worker.is_routable
                now[0] += 1.0
                assert worker.is_routable
                worker.record_success()
                worker.record_failure(_failure())                     # counting starts over
                await worker.probe()
                assert worker.is_routable
                assert _failure().is_worker_failure
            finally:
                await worker.client.close()

    asyncio.run(main())


def test_the_load_counts_our_requests_exactly_and_others_from_the_last_report() -> None:
    async def main() -> None:
        worker = Worker(Role.DECODE, "127.0.0.1:1")
        worker.num_in_flight = 2
        assert worker.queue_load == 2 and worker.num_free_pages == 0   # no report yet
        worker.load = WorkerLoad(num_running=5, num_waiting=1, num_free_pages=10, num_total_pages=64,
                                 num_cached_pages=6)
        worker._in_flight_at_load = 2          # two of the six it reported were ours
        assert worker.queue_load == 2 + 4 and worker.num_free_pages == 16
        worker.num_in_flight = 5               # three more since the report
        assert worker.queue_load == 9
        await worker.client.close()

    asyncio.run(main())
