"""Interactive traffic, counted so that batch work can yield to it.

`TrafficMiddleware` counts the HTTP requests in flight that are not batch work: every POST except
the `/v1/files` and `/v1/batches` routes (batch lines do not come through HTTP: they call the
operations, `gateway/service/batch_line.py`). A streamed response counts until its last byte is sent. The batch
runner calls `InteractiveTraffic.wait_quiet()` before it starts each batch line.
"""

from __future__ import annotations

import asyncio

_NOT_INTERACTIVE_PREFIXES = ("/v1/files", "/v1/batches")


class InteractiveTraffic:
    """The number of interactive requests in flight, and a wait for it to drop below `yield_threshold`.

    Lives on the event loop; not thread-safe.
    """

    def __init__(self, yield_threshold: int) -> None:
        if yield_threshold < 1:
            raise ValueError(f"yield_threshold must be >= 1, got {yield_threshold}")
        self.yield_threshold = yield_threshold
        self.num_in_flight = 0
        self._quiet = asyncio.Event()
        self._quiet.set()

    @property
    def is_quiet(self) -> bool:
        return self.num_in_flight < self.yield_threshold

    def enter(self) -> None:
        self.num_in_flight += 1
        if not self.is_quiet:
            self._quiet.clear()

    def leave(self) -> None:
        self.num_in_flight -= 1
        if self.is_quiet:
            self._quiet.set()

    async def wait_quiet(self) -> None:
        """Return once fewer than `yield_threshold` interactive requests are in flight."""
        while not self.is_quiet:
            await self._quiet.wait()


def is_interactive(scope: dict) -> bool:
    if scope["type"] != "http" or scope["method"] != "POST":
        return False
    return not scope["path"].startswith(_NOT_INTERACTIVE_PREFIXES)


class TrafficMiddleware:
    """ASGI middleware: counts interactive requests in `traffic` for as long as each one runs."""

    def __init__(self, app, traffic: InteractiveTraffic) -> None:
        self.app = app
        self.traffic = traffic

    async def __call__(self, scope, receive, send) -> None:
        if not is_interactive(scope):
            await self.app(scope, receive, send)
            return
        self.traffic.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.traffic.leave()
