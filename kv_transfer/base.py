"""The KV transport contract: errors, records, the `KVTransport` ABC and the backend registry.

A prefill server owns a KV pool (one contiguous, page-major buffer: page `i` occupies bytes
`[base_addr + i * page_bytes, base_addr + (i + 1) * page_bytes)`) and writes a request's pages
straight into pages that a decode server reserved in its own pool. The decode side describes its
reserved pages with `RemotePages`; the prefill side calls `KVTransport.write_pages`.

Backends register themselves by name with `@register_transport(name)` and are chosen once, at
start-up, by `create_transport(TransportConfig(backend=name))`.
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.config import ConfigError

logger = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")


class KVTransferError(Exception):
    """A KV transfer could not be set up or did not complete (bad arguments, unreachable peer,
    rejected or failed write, closed transport)."""


class KVTransferTimeout(KVTransferError):
    """A KV write did not complete within its deadline; the destination pages are undefined."""


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """How this process's KV transport is built.

    `backend` names a registered transport ("mooncake", "local"). `hostname` is the address peers
    use to reach this process. `protocol` is the wire protocol ("tcp" or "rdma"); `device_name`
    lists RDMA NICs (comma-separated) and must be empty for tcp. `transfer_timeout_s` is the
    longest a caller waits for one write (the prefill server's `--transfer-timeout`); a backend with
    its own transfer timeout sets it below this one. Invalid values raise `engine.config.ConfigError`.
    """

    backend: str = "mooncake"
    hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_name: str = ""
    transfer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.backend.strip():
            raise ConfigError("TransportConfig.backend must name a transport backend")
        if not self.hostname.strip() or any(c.isspace() for c in self.hostname):
            raise ConfigError(f"TransportConfig.hostname must be a host address, got {self.hostname!r}")
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"TransportConfig.protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.protocol == "tcp" and self.device_name:
            raise ConfigError(
                f"TransportConfig.device_name names RDMA NICs and must be empty for tcp, got {self.device_name!r}"
            )
        if not (self.transfer_timeout_s > 0 and math.isfinite(self.transfer_timeout_s)):
            raise ConfigError(
                f"TransportConfig.transfer_timeout_s must be a positive number of seconds, "
                f"got {self.transfer_timeout_s!r}"
            )


@dataclass(frozen=True, slots=True)
class RemotePages:
    """Destination of a page write: pages of a peer's registered KV pool.

    `session_id` is the peer transport's `KVTransport.session_id`; `base_addr` is the peer pool's
    base address in the peer's address space; destination page `p` is the byte range
    `[base_addr + p * page_bytes, base_addr + (p + 1) * page_bytes)`. `page_ids` are distinct,
    non-negative ints (a list is accepted and stored as a tuple).
    """

    session_id: str
    base_addr: int
    page_bytes: int
    page_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "page_ids", tuple(int(p) for p in self.page_ids))
        if not self.session_id:
            raise KVTransferError("RemotePages.session_id must not be empty")
        if self.base_addr <= 0:
            raise KVTransferError(f"RemotePages.base_addr must be positive, got {self.base_addr}")
        if self.page_bytes <= 0:
            raise KVTransferError(f"RemotePages.page_bytes must be positive, got {self.page_bytes}")
        if any(p < 0 for p in self.page_ids):
            raise KVTransferError(f"RemotePages.page_ids must be non-negative, got {self.page_ids}")
        if len(set(self.page_ids)) != len(self.page_ids):
            raise KVTransferError(f"RemotePages.page_ids must be distinct, got {self.page_ids}")


@dataclass(frozen=True, slots=True)
class TransferStats:
    """Outcome of one successful `write_pages` call: bytes written, wall-clock seconds from
    submission to completion, and the number of coalesced contiguous writes issued."""

    num_bytes: int
    seconds: float
    num_writes: int

    @property
    def bytes_per_second(self) -> float:
        """Throughput of the call; 0.0 when nothing was written."""
        return self.num_bytes / self.seconds if self.seconds > 0 else 0.0


class KVTransport(abc.ABC):
    """Writes pages of a local, registered KV pool into pages of a peer's registered KV pool.

    Lifecycle: construct (from a `TransportConfig`), `register` the pool once at start-up, publish
    `session_id` and the pool's base address to peers, call `write_pages` any number of times,
    `close`. Memory must be registered on both sides: the source range here, the destination
    range on the peer.

    Thread safety: `write_pages` may be called from several threads at once. `register` and
    `close` must not race with writes that use the memory they add or remove. A write's future is
    settled on whatever thread finishes the write (the caller's, or a backend's own), so its
    callbacks run there.

    Liveness: `write_pages` never waits for the peer; its future may take long to settle. A write
    to a stalled peer holds it until the backend gives up (for Mooncake, its own transfer timeout,
    `MC_TRANSFER_TIMEOUT`, set below `TransportConfig.transfer_timeout_s`, or its handshake wait of
    about 60 s). Callers therefore wait with their own deadline (see `check_timeout`) and raise
    `KVTransferTimeout` past it; the write may then still be in flight, so the destination pages
    hold undefined data and should not be reused by the peer immediately, and the source pages
    must stay allocated (the pool lives for the process, so they do). A caller that stops waiting
    cannot cancel a write: its future is already running.
    """

    @property
    @abc.abstractmethod
    def session_id(self) -> str:
        """How peers address this transport; goes into `RemotePages.session_id`."""

    def check_device(self, device: str) -> None:
        """Raise `KVTransferError` with the reason unless this transport can move memory of `device`
        (a torch device name: "cpu", "cuda", "cuda:<n>"). The default moves host memory only; a
        worker asks before it loads a model onto `device`."""
        if device != "cpu":
            raise KVTransferError(f"the {type(self).__name__} KV transport moves host memory only, not {device} memory")

    @abc.abstractmethod
    def register(self, base_addr: int, num_bytes: int, device: str = "cpu") -> None:
        """Register `[base_addr, base_addr + num_bytes)` of `device`'s memory ("cpu", or "cuda:<n>"
        for a pool on a GPU: the address is then a device pointer) so it can be the source of writes
        from here and the destination of writes from peers. Called once per pool at start-up; raises
        `KVTransferError` for an invalid or overlapping range, a device `check_device` refuses, or if
        the backend refuses it."""

    @abc.abstractmethod
    def write_pages(
        self, src_base_addr: int, src_page_ids: Sequence[int], dst: RemotePages
    ) -> concurrent.futures.Future[TransferStats]:
        """Start copying local page `src_page_ids[k]` (of the pool at `src_base_addr`) to the
        peer's page `dst.page_ids[k]`, for every k; page size is `dst.page_bytes` on both sides.

        Runs where both source and destination ids are consecutive are coalesced into one
        contiguous write, and all writes go to the backend as one batch. Returns at once with a
        future (possibly already settled) whose result is the `TransferStats` once every byte has
        landed. Every failure comes through the future as `KVTransferError`: id lists of different
        lengths, a source range not registered, an unknown or unreachable peer, a failed write, a
        closed transport; the checks that need no peer fail it before any byte moves. Mutates only
        the destination pages.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Unregister memory and release the backend; later writes fail with `KVTransferError`.
        Idempotent."""

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def settled_write(write: Callable[[], TransferStats]) -> concurrent.futures.Future[TransferStats]:
    """Run `write` on this thread now and return its outcome as a settled future: its stats, or
    the `KVTransferError` it raised (any other exception is a bug and propagates)."""
    future: concurrent.futures.Future[TransferStats] = concurrent.futures.Future()
    try:
        future.set_result(write())
    except KVTransferError as exc:
        future.set_exception(exc)
    return future


def check_timeout(timeout_s: float) -> None:
    """Raise `KVTransferError` unless `timeout_s` is a positive, finite number of seconds (a deadline
    a caller may wait for a write with)."""
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise KVTransferError(f"timeout_s must be a positive finite number, got {timeout_s!r}")


TransportFactory = Callable[[TransportConfig], KVTransport]
_TRANSPORTS: dict[str, TransportFactory] = {}


def register_transport(name: str) -> Callable[[TransportFactory], TransportFactory]:
    """Class decorator: make `create_transport` build this class for `backend == name`."""

    def decorate(factory: TransportFactory) -> TransportFactory:
        existing = _TRANSPORTS.get(name)
        if existing is not None and existing is not factory:
            raise ValueError(f"KV transport {name!r} is already registered by {existing!r}")
        _TRANSPORTS[name] = factory
        return factory

    return decorate


def available_transports() -> tuple[str, ...]:
    """Names of the registered transport backends, sorted."""
    return tuple(sorted(_TRANSPORTS))


def create_transport(config: TransportConfig) -> KVTransport:
    """Build the transport named by `config.backend`; raises `KVTransferError` for an unknown name
    (listing the known ones) or if the backend cannot start."""
    factory = _TRANSPORTS.get(config.backend)
    if factory is None:
        known = ", ".join(available_transports()) or "none"
        raise KVTransferError(f"unknown KV transport backend {config.backend!r}; known: {known}")
    logger.info("creating KV transport %r (hostname=%s, protocol=%s)", config.backend, config.hostname, config.protocol)
    return factory(config)
