"""In-process KV transport ("local"): peers are other `LocalTransport`s in the same process and a
write is a `memmove` between their registered pools, done by the caller's thread before
`write_pages` returns. For single-process serving and engine tests; it has no network and no
dependencies."""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import ClassVar

from kv_transfer.base import (
    KVTransferError,
    KVTransport,
    RemotePages,
    TransferStats,
    TransportConfig,
    register_transport,
    settled_write,
)
from kv_transfer.pages import plan_page_writes
from kv_transfer.regions import MemoryRegions

logger = logging.getLogger(__name__)


@register_transport("local")
class LocalTransport(KVTransport):
    """Writes pages with `ctypes.memmove` into a pool registered by another `LocalTransport` of
    this process, found by its session id (`local:<hex>`).

    Both ends are checked against their registered regions before any byte moves, so a bad id or
    page never corrupts memory outside a pool. A copy is synchronous and bounded by its size: the
    future `write_pages` returns is already settled. `config` fields other than `backend` are ignored.
    """

    # Registry of live transports by session id: how a session id reaches a pool in-process.
    _sessions: ClassVar[dict[str, LocalTransport]] = {}
    _sessions_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, config: TransportConfig | None = None) -> None:
        self._session_id = f"local:{uuid.uuid4().hex[:16]}"
        self._regions = MemoryRegions()
        self._is_closed = False
        with LocalTransport._sessions_lock:
            LocalTransport._sessions[self._session_id] = self
        logger.debug("local KV transport %s opened", self._session_id)

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, base_addr: int, num_bytes: int, device: str = "cpu") -> None:
        """Host memory only (`ctypes.memmove` cannot reach a GPU): other devices are refused."""
        if self._is_closed:
            raise KVTransferError(f"transport {self._session_id} is closed")
        self.check_device(device)
        region = self._regions.add(base_addr, num_bytes, device)
        logger.info(
            "local KV transport %s registered %d bytes at %#x", self._session_id, region.num_bytes, region.base_addr
        )

    def write_pages(
        self, src_base_addr: int, src_page_ids: Sequence[int], dst: RemotePages
    ) -> concurrent.futures.Future[TransferStats]:
        return settled_write(lambda: self._copy(src_base_addr, src_page_ids, dst))

    def _copy(self, src_base_addr: int, src_page_ids: Sequence[int], dst: RemotePages) -> TransferStats:
        if self._is_closed:
            raise KVTransferError(f"transport {self._session_id} is closed")
        plan = plan_page_writes(src_base_addr, src_page_ids, dst)
        self._regions.require(plan.src_addrs, plan.lengths, "source")
        with LocalTransport._sessions_lock:
            peer = LocalTransport._sessions.get(dst.session_id)
        if peer is None:
            raise KVTransferError(f"no local KV transport with session id {dst.session_id!r}")
        peer._regions.require(plan.dst_addrs, plan.lengths, f"destination on {dst.session_id}")
        start = time.perf_counter()
        for src_addr, dst_addr, num_bytes in zip(plan.src_addrs, plan.dst_addrs, plan.lengths):
            ctypes.memmove(dst_addr, src_addr, num_bytes)
        return TransferStats(plan.num_bytes, time.perf_counter() - start, plan.num_writes)

    def close(self) -> None:
        with LocalTransport._sessions_lock:
            LocalTransport._sessions.pop(self._session_id, None)
        self._is_closed = True
        self._regions.clear()
        logger.debug("local KV transport %s closed", self._session_id)
