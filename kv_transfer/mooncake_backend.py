"""KV transport over Mooncake's TransferEngine ("mooncake"), peer-to-peer handshake, no etcd.

`mooncake` is imported only here, and only when a transport is built, so importing `kv_transfer`
does not need it.

Mooncake's two listeners (handshake RPC and TCP data) bind every interface and no Mooncake setting
changes that; `kv_transfer.mooncake_binding` redirects their binds to the KV address
(`TransportConfig.hostname`, resolved to this machine's address) while the engine starts.

Why each write runs on its own helper thread, which settles the future `write_pages` returns:
both Mooncake calls a write needs can block far past any sensible deadline.
`batch_transfer_async_write` opens the peer's segment on first use and, if the peer accepts the
TCP connection but never answers the handshake (a stopped process), waits about 60 s.
`get_batch_transfer_status([batch_id])` is not a poll: it spins (GIL released) until every batch
completes (returns 0), one fails (returns -1), or Mooncake's own timeout passes (returns -1;
`MC_TRANSFER_TIMEOUT` seconds, at least 5, plus 1 ns per byte). It frees completed batch ids, so
it must be called exactly once per batch. The caller therefore waits on the future with its own
deadline; a helper that outlives the deadline finishes in the background and frees its batch when
Mooncake gives up. A helper thread of its own, not a shared pool's: a stalled peer holds it for up
to a minute, and must never hold up other work.

Mooncake reads its settings from the environment when its engine starts; the first transport of a
process sets them (`_set_mooncake_environment`), unless they are set already.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kv_transfer.base import (
    KVTransferError,
    KVTransport,
    RemotePages,
    TransferStats,
    TransportConfig,
    register_transport,
)
from kv_transfer.mooncake_binding import resolve_bind_address, wildcard_binds_redirected
from kv_transfer.pages import WritePlan, plan_page_writes
from kv_transfer.regions import MemoryRegions

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "the Mooncake transfer engine is not importable; install `mooncake-transfer-engine-non-cuda` "
    "(CPU) or `mooncake-transfer-engine` (CUDA) with pip, and the Debian/Ubuntu package "
    "`libibverbs1` (apt-get install libibverbs1)"
)

# batch_transfer_async_write returns 0 when it cannot submit; older releases returned -1, which
# pybind11 hands over as the unsigned 2**64 - 1.
_INVALID_BATCH_IDS = (0, -1, 2**64 - 1)


def load_transfer_engine_class() -> Any:
    """Import and return `mooncake.engine.TransferEngine`; raises `KVTransferError` with install
    instructions if Mooncake or one of its shared libraries is missing."""
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as exc:
        raise KVTransferError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    return TransferEngine


def moves_gpu_memory(engine_class: Any) -> bool:
    """Whether this Mooncake build can register and move GPU memory: only the CUDA build (wheel
    `mooncake-transfer-engine`, built with USE_CUDA) binds the stream-ordered `*_on_cuda` calls, and
    only it resolves a device pointer's location (Mooncake's build docs: USE_CUDA is needed to
    transfer GPU memory, over TCP too). The CPU wheel (`mooncake-transfer-engine-non-cuda`) has the
    same module and calls otherwise, so its methods tell the two apart."""
    return hasattr(engine_class, "batch_transfer_write_on_cuda")


def installed_build_moves_gpu_memory() -> bool:
    """`moves_gpu_memory` of the installed Mooncake; False when none is importable."""
    try:
        return moves_gpu_memory(load_transfer_engine_class())
    except KVTransferError:
        return False


def _engine_library_dir() -> Path:
    """The folder of Mooncake's `engine` extension, which the shared objects it loads sit in or
    beside."""
    import mooncake.engine

    return Path(mooncake.engine.__file__).parent


def _set_mooncake_environment(config: TransportConfig) -> None:
    """Mooncake's settings, before its engine starts; a value already in the environment wins."""
    # Mooncake's own transfer timeout must fire before the caller's deadline, so a write the caller
    # gave up on can never land later in pages the decode server has freed and handed to another
    # request.
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, int(config.transfer_timeout_s * 0.8))))
    # Mooncake logs a line per transfer at INFO: keep its warnings and errors unless we debug
    # (per-transfer numbers are in the worker's metrics).
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if logger.isEnabledFor(logging.DEBUG) else "WARNING")


def _run_batch(
    engine: Any, session_id: str, plan: WritePlan, write: concurrent.futures.Future[TransferStats], start: float
) -> None:
    """Helper-thread body: submit `plan` as one async batch, wait for it, settle `write` (its
    seconds count from `start`, the `perf_counter` of the call that asked for it)."""
    try:
        batch_id = engine.batch_transfer_async_write(
            session_id, list(plan.src_addrs), list(plan.dst_addrs), list(plan.lengths)
        )
        if batch_id in _INVALID_BATCH_IDS:
            raise KVTransferError(
                f"Mooncake could not submit a write to {session_id} (peer unreachable, "
                f"handshake failed, or the batch was rejected)"
            )
        status = engine.get_batch_transfer_status([batch_id])
        if status != 0:
            raise KVTransferError(
                f"Mooncake write of {plan.num_bytes} bytes to {session_id} failed (status {status}):"
                f" destination not registered on the peer, peer gone, or Mooncake's timeout hit"
            )
    except KVTransferError as exc:
        logger.warning("KV write to %s failed: %s", session_id, exc)
        write.set_exception(exc)
    except Exception as exc:  # noqa: BLE001 - any failure must reach the waiting caller
        error = KVTransferError(f"Mooncake raised {exc!r} writing to {session_id}")
        error.__cause__ = exc
        logger.warning("KV write to %s failed: %s", session_id, error)
        write.set_exception(error)
    else:
        seconds = time.perf_counter() - start
        logger.debug(
            "wrote %d bytes in %d runs to %s in %.3f ms", plan.num_bytes, plan.num_writes, session_id, seconds * 1e3
        )
        write.set_result(TransferStats(num_bytes=plan.num_bytes, seconds=seconds, num_writes=plan.num_writes))


@register_transport("mooncake")
class MooncakeTransport(KVTransport):
    """A Mooncake TransferEngine with P2P handshake; `session_id` is `"<address>:<rpc port>"`, where the
    address is the one of this machine that `TransportConfig.hostname` names (the hostname itself only
    when it is a wildcard). Peers get the address, not the name: a name several machines share (a
    Compose service scaled to several replicas, each resolving its own name to itself) would send a
    peer's writes to whichever replica the peer's resolver picked.

    Writes are one-sided: the peer's CPU does not take part beyond its transport threads, and the
    peer's engine rejects writes outside memory it registered. Mooncake does not check that the
    source is registered (over tcp), so this class does.
    """

    def __init__(self, config: TransportConfig) -> None:
        engine_class = load_transfer_engine_class()
        _set_mooncake_environment(config)
        bind_address = resolve_bind_address(config.hostname)
        listening: contextlib.AbstractContextManager[None]
        if bind_address is None:
            listening = contextlib.nullcontext()
            logger.warning("KV host %s is a wildcard: Mooncake listens on every interface", config.hostname)
        else:
            listening = wildcard_binds_redirected(_engine_library_dir(), bind_address)
        advertised = bind_address or config.hostname
        with listening:
            engine = engine_class()
            rc = engine.initialize(advertised, "P2PHANDSHAKE", config.protocol, config.device_name)
        if rc != 0:
            hint = " (an IPv6 KV address needs MC_USE_IPV6=1)" if ":" in (bind_address or "") else ""
            raise KVTransferError(
                f"Mooncake TransferEngine.initialize({advertised!r}, P2PHANDSHAKE, "
                f"{config.protocol!r}, {config.device_name!r}) failed with code {rc}{hint}"
            )
        self._engine: Any = engine
        self._moves_gpu_memory = moves_gpu_memory(engine_class)
        self._session_id = f"{advertised}:{engine.get_rpc_port()}"
        self._regions = MemoryRegions()
        self._lock = threading.Lock()
        logger.info(
            "Mooncake KV transport %s started (protocol=%s, listening on %s)",
            self._session_id,
            config.protocol,
            bind_address or "every interface",
        )

    @property
    def session_id(self) -> str:
        return self._session_id

    def _live_engine(self) -> Any:
        with self._lock:
            if self._engine is None:
                raise KVTransferError(f"Mooncake transport {self._session_id} is closed")
            return self._engine

    def check_device(self, device: str) -> None:
        """Host memory always; GPU memory only with Mooncake's CUDA build."""
        if device != "cpu" and not self._moves_gpu_memory:
            raise KVTransferError(
                f"the installed Mooncake is its CPU build (mooncake-transfer-engine-non-cuda), which cannot "
                f"move {device} memory: install the CUDA build `mooncake-transfer-engine` in its place (the "
                f"CUDA worker image does; pip uninstall the CPU wheel first), or run with --device cpu"
            )

    def register(self, base_addr: int, num_bytes: int, device: str = "cpu") -> None:
        """One `register_memory` call. Its location stays Mooncake's default "*": the CUDA build then
        asks CUDA where the pointer lives (`cuda:<n>` for a device pool, which also picks the NICs
        nearest that GPU for RDMA), as SGLang registers its GPU KV buffers."""
        engine = self._live_engine()
        self.check_device(device)
        region = self._regions.add(base_addr, num_bytes, device)
        rc = engine.register_memory(region.base_addr, region.num_bytes)
        if rc != 0:
            self._regions.remove(region)
            raise KVTransferError(
                f"Mooncake register_memory({region.base_addr:#x}, {region.num_bytes}) of {device} memory "
                f"failed with code {rc}"
            )
        logger.info(
            "Mooncake KV transport %s registered %d bytes of %s memory at %#x",
            self._session_id,
            region.num_bytes,
            device,
            region.base_addr,
        )

    def write_pages(
        self, src_base_addr: int, src_page_ids: Sequence[int], dst: RemotePages
    ) -> concurrent.futures.Future[TransferStats]:
        write: concurrent.futures.Future[TransferStats] = concurrent.futures.Future()
        write.set_running_or_notify_cancel()  # so a caller that stops waiting cannot cancel it
        try:
            engine = self._live_engine()
            plan = plan_page_writes(src_base_addr, src_page_ids, dst)
            self._regions.require(plan.src_addrs, plan.lengths, "source")
        except KVTransferError as exc:
            write.set_exception(exc)
            return write
        if plan.num_writes == 0:
            write.set_result(TransferStats(num_bytes=0, seconds=0.0, num_writes=0))
            return write
        threading.Thread(
            target=_run_batch,
            args=(engine, dst.session_id, plan, write, time.perf_counter()),
            name=f"kv-write-{dst.session_id}",
            daemon=True,
        ).start()
        return write

    def close(self) -> None:
        """Unregister memory, so peers' late writes are rejected, and drop the engine; helpers
        still running keep their own reference and release it when they finish."""
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is None:
            return
        for region in self._regions.clear():
            rc = engine.unregister_memory(region.base_addr)
            if rc != 0:
                logger.warning("Mooncake unregister_memory(%#x) failed with code %d", region.base_addr, rc)
        logger.info("Mooncake KV transport %s closed", self._session_id)
