"""A prefill worker's side of the handoff, as the engine's KV connector (engine/kv_connector.py).

The prefill servicer puts a `KVSend` in the request's `kv_params`: which of the decode worker's pages
take the prompt's KV (`RemotePages`, the pages after those decode already holds), until when its grant
holds and how long the write may take. Once the engine has computed the prompt, `KVSendConnector`
writes the pages with the worker's `KVTransport` and keeps them until the write is over, or past its
deadline: a write cannot be called back, so an aborted request's pages still wait for it. The outcome
(`TransferStats`, or the `KVTransferError`) settles `KVSend.written`, which the servicer awaits with
`await_write`; the pages are the engine's business alone.

The engine thread calls `on_finished`, `start_saves` and `poll`; a write settles on the transport's
thread, which then calls `wake` so an idle engine loop polls at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_connector import KVConnector, KVPoll
from engine.request import Request
from kv_transfer import KVTransferError, KVTransferTimeout, KVTransport, RemotePages, TransferStats, check_timeout

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVSend:
    """Where a prefill-only request's KV goes: its pages from `first_page` on, one per page of `dst`. The
    decode worker's grant expires at `expires_unix_ms` (no write starts after it); the write may take
    `timeout_s`. `written` settles with the write's `TransferStats` or its `KVTransferError`. It is
    running (`written.running()`) from the moment the engine computed the prompt, so once the engine has
    seen the request's abort, a `written` that is neither running nor done never settles: no write
    of this send was or will be started."""

    dst: RemotePages
    first_page: int
    expires_unix_ms: int
    timeout_s: float
    written: concurrent.futures.Future[TransferStats] = field(default_factory=concurrent.futures.Future)

    def __post_init__(self) -> None:
        check_timeout(self.timeout_s)


class KVSendConnector(KVConnector):
    """Sends prefill-only requests' KV from the pool at `pool_base_addr` through `transport`."""

    def __init__(self, transport: KVTransport, pool_base_addr: int, wake: Callable[[], None] = lambda: None) -> None:
        self.transport = transport
        self.pool_base_addr = pool_base_addr
        self.wake = wake  # called from the transport's thread when a write settles
        self._accepted: list[tuple[str, KVSend, list[int]]] = []  # this step's, to start in start_saves
        self._running: dict[str, tuple[KVSend, float]] = {}  # request id -> its send and its deadline

    def on_finished(self, req: Request) -> bool:
        send = req.kv_params
        if not isinstance(send, KVSend):
            return False
        send.written.set_running_or_notify_cancel()  # from now on `written` settles: see KVSend
        src_pages = req.page_ids[send.first_page : send.first_page + len(send.dst.page_ids)]
        self._accepted.append((req.request_id, send, src_pages))
        return True

    def start_saves(self) -> None:
        accepted, self._accepted = self._accepted, []
        for request_id, send, src_pages in accepted:
            self._running[request_id] = (send, time.monotonic() + send.timeout_s)
            if send.expires_unix_ms <= time.time() * 1000:  # the decode side may have let its pages go
                send.written.set_exception(
                    KVTransferError("the decode reservation expired before the prompt's KV was ready")
                )
                continue
            if len(src_pages) != len(send.dst.page_ids):
                send.written.set_exception(
                    KVTransferError(
                        f"the prompt has {len(src_pages)} pages to send, the target {len(send.dst.page_ids)}"
                    )
                )
                continue
            write = self.transport.write_pages(self.pool_base_addr, src_pages, send.dst)
            write.add_done_callback(functools.partial(self._settle, send))

    def _settle(self, send: KVSend, write: concurrent.futures.Future[TransferStats]) -> None:
        """On the thread that finished the write: pass its outcome on and wake the engine loop."""
        exc = write.exception()
        if exc is None:
            send.written.set_result(write.result())
        else:
            send.written.set_exception(exc)
        self.wake()

    def poll(self) -> KVPoll:
        now = time.monotonic()
        over = [rid for rid, (send, deadline) in self._running.items() if send.written.done() or now >= deadline]
        for request_id in over:
            del self._running[request_id]
        return KVPoll(sent=over)

    @property
    def num_running(self) -> int:
        return len(self._running)


async def await_write(send: KVSend) -> TransferStats:
    """`send`'s write, awaited up to its `timeout_s`: its stats, its KVTransferError, or KVTransferTimeout
    past the deadline (the write may go on: the destination pages are then undefined; see `KVTransport`).
    A caller cancelled while waiting leaves the write running."""
    try:
        # shielded: a wait that ends must not cancel `written`, which the connector still settles
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(send.written)), send.timeout_s)
    except TimeoutError:
        dst = send.dst
        num_bytes = len(dst.page_ids) * dst.page_bytes
        logger.warning("KV write of %d bytes to %s timed out after %.3f s", num_bytes, dst.session_id, send.timeout_s)
        raise KVTransferTimeout(
            f"write of {num_bytes} bytes to {dst.session_id} did not complete within {send.timeout_s} s"
        ) from None
