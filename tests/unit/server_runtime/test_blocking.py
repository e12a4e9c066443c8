"""server_runtime/blocking.py: `BlockingWork` and its `Lane`s, and `use_device`. The engine
thread itself runs in the integration tests."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from server_runtime.blocking import BlockingWork


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


def test_an_indexed_cuda_device_becomes_the_threads_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's current device is per thread; what the engine thread selects (no GPU here: the call is recorded)."""
    from server_runtime.blocking import use_device

    selected: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    for device in ("cpu", "cuda", "meta"):
        use_device(device)
    assert selected == []   # cpu and meta have no CUDA device; "cuda" is device 0, already current
    use_device("cuda:1")
    assert selected == [1]
