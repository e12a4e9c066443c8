"""The cluster-wide KV store on Mooncake Store: the store itself (`tandem kv-store`) and a worker's client.

The store is two parts in one process: Mooncake's `mooncake_master` (a binary in the mooncake wheel),
which keeps the table of objects and leases, and a Mooncake store client that mounts `memory_bytes` of
this process's memory as the segment the objects live in. Workers connect as clients that mount no
memory of their own, so the pages outlive every worker: a restarted worker, or any other one, finds
what the others put. Clients find each other by Mooncake's P2P handshake (no metadata server).

Every listener binds the address it is given: the master's RPC and metrics by its flags, the Mooncake
transfer engines (the store's and each worker's) through `kv_transfer.mooncake_binding`. Mooncake's
master checks no credentials, so the pages carry their own: the engine signs each page it puts and
checks the tag of each it gets (`engine/kv_store_tier.py`), with a key the store never holds.

A worker's client never holds up the engine thread for long: every call to Mooncake runs on a thread
of the client's own, the engine waits at most `timeout_s` for an answer, and after a failure the store
counts as away for `retry_after_s`, during which every lookup is a miss (the page is recomputed).
Mooncake's calls block for seconds while the master is down (about 4 s each), and reconnect by
themselves once it is back.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import importlib.util
import logging
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kv_transfer.base import KVTransferError
from kv_transfer.mooncake_backend import INSTALL_HINT
from kv_transfer.mooncake_binding import resolve_bind_address, wildcard_binds_redirected

logger = logging.getLogger(__name__)

T = TypeVar("T")

_MAX_PENDING_PUTS = 64  # pages waiting to be put; past this, new ones are dropped (the cache is best effort)


def _store_class() -> Any:
    """`mooncake.store.MooncakeDistributedStore`; KVTransferError with install instructions if missing."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except (ImportError, OSError) as exc:
        raise KVTransferError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    return MooncakeDistributedStore


def _library_dir() -> Path:
    import mooncake.store

    return Path(mooncake.store.__file__).parent


def master_binary() -> Path:
    """The `mooncake_master` the installed mooncake wheel ships; KVTransferError when there is none."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(folder) / "mooncake_master"
        if binary.is_file():
            return binary
    raise KVTransferError(f"no mooncake_master found: {INSTALL_HINT}")


def _connect(hostname: str, master: str, segment_bytes: int) -> Any:
    """A Mooncake store client of the master at `master` ("host:port"), its listeners bound to the
    address `hostname` names, mounting `segment_bytes` of memory into the store (0: none)."""
    store_class = _store_class()
    _check_master_answers(master)
    bind_address = resolve_bind_address(hostname)
    listening: contextlib.AbstractContextManager[None] = (
        contextlib.nullcontext() if bind_address is None else wildcard_binds_redirected(_library_dir(), bind_address)
    )
    store = store_class()
    with listening:
        # local_buffer_size: the client's staging buffer for gets and puts; 16 MiB holds many pages.
        rc = store.setup(bind_address or hostname, "P2PHANDSHAKE", segment_bytes, 16 * 2**20, "tcp", "", master)
    if rc != 0:
        raise KVTransferError(f"cannot reach the KV store at {master} (Mooncake setup returned {rc})")
    return store


def _check_master_answers(master: str) -> None:
    """KVTransferError unless the master at `master` accepts a connection within a second: Mooncake's own
    setup tries for about 90 s before it gives up on a master that is not there."""
    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
    except (OSError, ValueError) as exc:
        raise KVTransferError(f"the KV store at {master} does not answer ({exc})") from None


class StoreClient:
    """A worker's connection to the KV store at `master` ("host:port"), listening on the address
    `hostname` names. Connects in the background; until then, and while the store is away, lookups
    miss and puts are dropped. `get` and `put` are the `engine.kv_store_tier.PageStore`
    a worker's engine uses; call them from one thread (the engine's). Counters: `num_failures`
    (lookups that failed or timed out), `num_failed_puts`."""

    def __init__(self, master: str, hostname: str, timeout_s: float = 0.25, retry_after_s: float = 5.0) -> None:
        self.master, self.hostname = master, hostname
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self.num_failures = 0
        self.num_failed_puts = 0
        self._store: Any = None
        self._away_until = 0.0
        # One thread for the calls the engine waits for, one for puts: a put never delays a lookup.
        self._calls = _Lane("kv-store")
        self._puts = _Lane("kv-store-put")
        self._pending_puts = 0
        self._lock = threading.Lock()
        self._connecting: concurrent.futures.Future[None] | None = None
        self._closed = False
        self._start_connecting()

    @property
    def is_connected(self) -> bool:
        return self._store is not None

    @property
    def num_pending_puts(self) -> int:
        """Puts queued that have not reached the store (nor failed) yet."""
        return self._pending_puts

    def _start_connecting(self) -> None:
        if self._connecting is None or self._connecting.done():
            self._connecting = self._calls.submit(self._connect_once)

    def _connect_once(self) -> None:
        if self._store is not None or self._closed:
            return
        try:
            self._store = _connect(self.hostname, self.master, 0)
        except KVTransferError as exc:
            self._away_until = time.monotonic() + self.retry_after_s
            logger.warning("KV store: %s; pages are recomputed meanwhile, retrying in %.0f s", exc, self.retry_after_s)
            return
        logger.info("KV store: connected to %s", self.master)

    def _is_away(self) -> bool:
        if self._store is None:
            if time.monotonic() >= self._away_until:
                self._start_connecting()
            return True
        return time.monotonic() < self._away_until

    def _failed(self, what: str, exc: BaseException | None) -> None:
        self.num_failures += 1
        first = time.monotonic() >= self._away_until
        self._away_until = time.monotonic() + self.retry_after_s
        if first:
            reason = "no answer in time" if exc is None else repr(exc)
            logger.warning(
                "KV store at %s: %s failed (%s); lookups miss for %.0f s", self.master, what, reason, self.retry_after_s
            )

    def _call(self, what: str, call: Callable[[Any], T], miss: T) -> T:
        """`call(store)` on the calls thread, its answer within `timeout_s`; `miss` when the store is
        away, the call fails, or no answer comes in time."""
        if self._is_away():
            return miss
        store = self._store
        try:
            return self._calls.submit(call, store).result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._failed(what, None)
        except RuntimeError as exc:  # what Mooncake's bindings raise
            self._failed(what, exc)
        return miss

    def get(self, key: str) -> bytes | None:
        """The object stored under `key`; None when there is none or the store does not answer."""
        value = self._call("get", lambda store: store.get(key), b"")
        return value or None  # Mooncake answers b"" for a missing key and for a failed lookup

    def put(self, key: str, value: bytes) -> None:
        """Store `value` under `key` in the background; dropped when the store is away or too many
        puts are pending."""
        if self._is_away():
            return
        with self._lock:
            if self._pending_puts >= _MAX_PENDING_PUTS:
                return
            self._pending_puts += 1
        self._puts.submit(self._put, key, value)

    def _put(self, key: str, value: bytes) -> None:
        """A failed put costs a recompute later, nothing now: counted. One that fails slowly (Mooncake
        waits about 4 s for a master that is gone) marks the store away, so the puts queued behind it are
        dropped instead of each waiting as long."""
        try:
            if self._closed or self._is_away():
                return
            started = time.monotonic()
            try:
                failed = self._store.put(key, value) != 0
            except RuntimeError:
                failed = True
            if failed:
                self.num_failed_puts += 1
                if time.monotonic() - started > self.timeout_s:
                    self._away_until = time.monotonic() + self.retry_after_s
        finally:
            with self._lock:
                self._pending_puts -= 1

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until the puts queued so far are done (tests; a clean stop)."""
        self._puts.submit(lambda: None).result(timeout_s)

    def close(self) -> None:
        """Drop the puts still queued; later calls miss."""
        self._closed = True
        self._away_until = float("inf")


class _Lane:
    """One daemon thread running calls in order. Daemon: a call stuck in Mooncake (seconds, while the master
    is gone) never holds up the worker's exit, as an executor's thread would."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]]
        self._queue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, call: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((future, call, args))
        return future

    def _run(self) -> None:
        while True:
            future, call, args = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call(*args))
            except BaseException as exc:  # noqa: BLE001 - it belongs to whoever waits on the future
                future.set_exception(exc)


def master_command(host: str, port: int, metrics_port: int) -> list[str]:
    """`mooncake_master`'s command line: RPC on `host:port`, metrics on `host:metrics_port`, pages
    evicted least recently used first when the store's memory is 90% full."""
    return [
        str(master_binary()),
        f"-rpc_address={host}",
        f"-rpc_port={port}",
        f"-metrics_host={host}",
        f"-metrics_port={metrics_port}",
        "-enable_http_metadata_server=false",
        "-enable_metric_reporting=false",
        "-logtostderr",
        "-minloglevel=1",
    ]


def run_store(host: str, port: int, memory_bytes: int, metrics_port: int) -> int:
    """`tandem kv-store`: run the master, mount `memory_bytes` of this process's memory as the store's
    segment, and wait; stops the master on SIGTERM or SIGINT. Returns the exit status: 1 when the
    master stopped by itself or the memory could not be mounted."""
    bind_address = resolve_bind_address(host)
    if bind_address is None:
        raise KVTransferError(f"the KV store needs an address of this machine, not the wildcard {host!r}")
    master = subprocess.Popen(master_command(bind_address, port, metrics_port), preexec_fn=_die_with_parent)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        store = _mount_when_master_answers(bind_address, f"{bind_address}:{port}", memory_bytes, master)
        if store is None:
            return 1
        logger.info(
            "KV store ready on %s:%d (%.1f GiB; metrics on port %d)",
            bind_address,
            port,
            memory_bytes / 2**30,
            metrics_port,
        )
        while not stop.wait(1.0):
            if master.poll() is not None:
                logger.error("mooncake_master stopped (exit status %s)", master.returncode)
                return 1
        store.close()  # unmount while the master still answers (after it, Mooncake waits for it ~10 s)
        return 0
    finally:
        if master.poll() is None:
            master.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                master.wait(10)
        if master.poll() is None:
            master.kill()


def _die_with_parent() -> None:
    """In the master's process before it runs: SIGTERM when this process dies, however it dies."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _mount_when_master_answers(hostname: str, master: str, memory_bytes: int, process: subprocess.Popen) -> Any:
    """The store client holding the store's memory, once the master started by `process` answers
    (None if the master died first, or did not answer within a minute)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return _connect(hostname, master, memory_bytes)
        except KVTransferError as exc:
            if process.poll() is not None:
                logger.error("mooncake_master stopped (exit status %s) before it answered", process.returncode)
                return None
            if time.monotonic() > deadline:
                logger.error("%s", exc)
                return None
            time.sleep(0.5)
