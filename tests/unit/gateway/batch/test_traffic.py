"""Counting interactive requests, and waiting for them to drop below the threshold."""

from __future__ import annotations

import asyncio

import pytest

from gateway.batch.traffic import InteractiveTraffic, TrafficMiddleware, is_interactive


def scope(method: str = "POST", path: str = "/v1/chat/completions", headers=()) -> dict:
    return {"type": "http", "method": method, "path": path, "headers": list(headers)}


def test_only_interactive_posts_count() -> None:
    assert is_interactive(scope())
    assert is_interactive(scope(path="/generate"))
    assert not is_interactive(scope(method="GET", path="/v1/models"))
    assert not is_interactive(scope(path="/v1/files"))
    assert not is_interactive(scope(path="/v1/batches/batch_1/cancel"))
    assert not is_interactive({"type": "lifespan"})


def test_wait_quiet_waits_until_fewer_than_the_threshold_are_in_flight() -> None:
    async def main() -> None:
        traffic = InteractiveTraffic(yield_threshold=2)
        traffic.enter()
        await asyncio.wait_for(traffic.wait_quiet(), 1)   # 1 < 2: quiet
        traffic.enter()
        waiter = asyncio.create_task(traffic.wait_quiet())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        traffic.leave()
        await asyncio.wait_for(waiter, 1)

    asyncio.run(main())
    with pytest.raises(ValueError):
        InteractiveTraffic(0)


def test_middleware_counts_a_request_while_it_runs() -> None:
    async def main() -> None:
        traffic = InteractiveTraffic(1)
        seen = []

        async def app(scope, receive, send) -> None:
            seen.append(traffic.num_in_flight)
            if scope["path"] == "/boom":
                raise RuntimeError("boom")

        middleware = TrafficMiddleware(app, traffic)
        await middleware(scope(), None, None)
        await middleware(scope(path="/v1/files"), None, None)
        with pytest.raises(RuntimeError):
            await middleware(scope(path="/boom"), None, None)
        assert seen == [1, 0, 1] and traffic.num_in_flight == 0 and traffic.is_quiet

    asyncio.run(main())
