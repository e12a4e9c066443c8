"""Stop work for a client that went away before its response started.

Starlette cancels a streaming response whose client disconnects, but not an endpoint still working
on its answer: a non-streaming generation, or a stream waiting for its first token, would run to
the end for nobody, holding KV pages meanwhile. `cancel_on_disconnect` races such work against the
client's `http.disconnect` and cancels it (which releases everything it held) when the client wins.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from gateway.errors import APIError
from gateway.service.guard import Guard

T = TypeVar("T")
logger = logging.getLogger(__name__)


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (and awaited,
    so its clean-up has run) and a 499 is raised, which nobody will read. The body must have been
    read already (FastAPI has, for a JSON body): afterwards the only message left is the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the endpoint itself was cancelled
        watcher.cancel()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    logger.info("the client closed %s before its answer; its generation was cancelled", request.url.path)
    raise APIError(499, "the client closed the request", "client_closed_request")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def disconnect_guard(request: Request) -> Guard:
    """The `Guard` of an HTTP route: `cancel_on_disconnect` for `request`."""

    async def guard(work: Awaitable[T], /) -> T:
        return await cancel_on_disconnect(request, work)

    return guard
