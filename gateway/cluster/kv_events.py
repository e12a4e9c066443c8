"""Each worker's KV events, followed: `follow_kv_events` keeps one SubscribeKvEvents stream open to a
worker and feeds what it says into the worker's `EventIndex` (`gateway/cluster/prefix_index.py`), the
router's exact view of that worker's prefix cache.

The pool (`gateway/cluster/pool.py`) runs one per ready worker with a prefix cache and cancels it when
it closes or the worker leaves. A stream that breaks (the worker restarted, the connection dropped)
makes the index stale until the next stream's snapshot replaces it: the router guesses meanwhile. It
is opened again after a back-off that doubles while streams keep failing soon after they open. A
worker that answers UNIMPLEMENTED (a version without the RPC) is not asked again: the call returns.
Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.cluster.client import KvEventsEnded, WorkerClient
from gateway.cluster.prefix_index import EventIndex
from gateway.cluster.worker_records import KvEvents

logger = logging.getLogger(__name__)

_MIN_BACKOFF_S = 0.25
_MAX_BACKOFF_S = 5.0
# A stream that stayed open this long was a working one: the next back-off starts over from the least.
_STABLE_STREAM_S = 10.0


async def follow_kv_events(
    client: WorkerClient,
    index: EventIndex,
    on_events: Callable[[KvEvents], None] = lambda events: None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Keep the worker's KV event stream open and apply each message to `index` (then hand it to
    `on_events`, the metrics). Runs until cancelled; returns only when the worker does not know the
    RPC. `index` is not live whenever no stream is."""
    backoff_s = _MIN_BACKOFF_S
    while True:
        opened = clock()
        stream = client.kv_events()
        try:
            while True:
                events = await stream.read()
                index.apply(events)
                on_events(events)
        except KvEventsEnded as exc:
            if exc.is_unsupported:
                logger.info(
                    "%s worker %s publishes no KV events (%s); routing guesses its prefix cache",
                    client.role,
                    client.address,
                    exc.detail,
                )
                return
            log = logger.info if index.is_live else logger.debug  # a worker still starting fails quietly
            log("%s worker %s: KV event stream ended (%s)", client.role, client.address, exc.detail)
        finally:
            stream.cancel()
            index.lose()
        if clock() - opened >= _STABLE_STREAM_S:
            backoff_s = _MIN_BACKOFF_S
        await asyncio.sleep(backoff_s)
        backoff_s = min(_MAX_BACKOFF_S, backoff_s * 2)
