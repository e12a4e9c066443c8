"""The blocking-work side of server_runtime/engine_loop.py: `BlockingWork`, its `Lane`s, and a KV write
awaited with its deadline (`write_pages`). The engine thread itself runs in the integration tests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest
import torch

from kv_transfer import KVTransferError, KVTransferTimeout, RemotePages, TransportConfig, create_transport
from server_runtime.engine_loop import BlockingWork, write_pages


def test_run_returns_results_and_raises_errors_off_the_event_loop() -> None:
    async def scenario() -> None:
        work = BlockingWork(asyncio.get_running_loop())
        try:
            assert await work.run(threading.current_thread) is not threading.current_thread()
            with pytest.raises(ZeroDivisionError):
                await work.run(lambda: 1 / 0)
        finally:
            work.close()
    asyncio.run(scenario())


def test_a_lane_runs_one_call_at_a_time_even_after_its_caller_gave_up() -> None:
    spans: list[tuple[str, float, float]] = []

    def call(name: str, seconds: float) -> str:
        start = time.monotonic()
        time.sleep(seconds)
        spans.append((name, start, time.monotonic()))
        return name

    async def scenario() -> None:
        work = BlockingWork(asyncio.get_running_loop())
        lane = work.lane()
        try:
            with pytest.raises(TimeoutError):
                await lane.run(call, "slow", 0.3, timeout_s=0.05)   # goes on, holding the lane
            assert await asyncio.gather(lane.run(call, "a", 0.01), lane.run(call, "b", 0.01)) == ["a", "b"]
        finally:
            work.close()
    asyncio.run(scenario())
    assert [name for name, _, _ in spans] == ["slow", "a", "b"]
    for (_, _, end), (_, start, _) in zip(spans, spans[1:]):
        assert start >= end   # never overlapping


def test_a_kv_write_is_awaited_with_its_deadline() -> None:
    src, dst = torch.randn(4, 8), torch.zeros(4, 8)
    with create_transport(TransportConfig(backend="local")) as sender, \
            create_transport(TransportConfig(backend="local")) as receiver:
        for transport, pool in ((sender, src), (receiver, dst)):
            transport.register(pool.data_ptr(), pool.numel() * pool.element_size())
        target = RemotePages(receiver.session_id, dst.data_ptr(), 8 * 4, (2, 3))
        stats = asyncio.run(write_pages(sender, src.data_ptr(), [0, 1], target, timeout_s=5))
        assert stats.num_bytes == 64 and torch.equal(dst[2:], src[:2])
        with pytest.raises(KVTransferError, match="timeout_s"):   # refused before anything moves
            asyncio.run(write_pages(sender, src.data_ptr(), [0, 1], target, timeout_s=0))


class _StalledTransport:
    """A transport whose writes never end, as Mooncake's to a stopped peer."""

    def __init__(self) -> None:
        self.write: concurrent.futures.Future = concurrent.futures.Future()

    def write_pages(self, src_base_addr, src_page_ids, dst) -> concurrent.futures.Future:
        self.write.set_running_or_notify_cancel()
        return self.write


def test_a_kv_write_past_its_deadline_times_out_and_is_left_running() -> None:
    transport = _StalledTransport()
    target = RemotePages("peer:1", 4096, 1024, (0, 1))
    started = time.monotonic()
    with pytest.raises(KVTransferTimeout, match="write of 2048 bytes to peer:1 did not complete within 0.05 s"):
        asyncio.run(write_pages(transport, 4096, [0, 1], target, timeout_s=0.05))   # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0
    assert transport.write.running()   # the caller gave up; the write was not cancelled under the backend


def test_an_indexed_cuda_device_becomes_the_threads_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's current device is per thread; what the engine thread selects (no GPU here: the call is recorded)."""
    from server_runtime.engine_loop import use_device

    selected: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    for device in ("cpu", "cuda", "meta"):
        use_device(device)
    assert selected == []   # cpu and meta have no CUDA device; "cuda" is device 0, already current
    use_device("cuda:1")
    assert selected == [1]
