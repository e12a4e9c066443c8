"""Which workers the gateway uses: static `host:port` addresses, or DNS names expanded to every address.

A `--prefill`/`--decode` value is either

- `host:port` (static): one worker; gRPC resolves `host` itself when it connects, as before; or
- `dns:///name:port`: every address `name` resolves to is one worker, re-resolved every
  `REFRESH_INTERVAL_S` seconds. A Kubernetes headless Service resolves to the IPs of its ready pods,
  so pods that start are added and pods that go away (deleted, failing readiness) are dropped.

`RoleDiscovery` answers "which addresses now" for one role; `WorkerPool` (`gateway/cluster/pool.py`)
turns the answer into `Worker`s. A name that does not exist (NXDOMAIN, which is what a headless
Service with no ready pod answers) means no workers; a resolver that fails for another reason
(timeout, no DNS server) keeps the last answer, so a DNS hiccup does not empty the pool.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DNS_PREFIX = "dns:///"
REFRESH_INTERVAL_S = 5.0
# getaddrinfo errors that mean "this name has no addresses", as opposed to "could not ask".
_NO_SUCH_NAME = frozenset(
    code for code in (getattr(socket, "EAI_NONAME", None), getattr(socket, "EAI_NODATA", None)) if code is not None
)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One `--prefill`/`--decode` value, parsed: a host (name or IP literal), a port, and whether the
    host is a DNS name to expand to all of its addresses."""

    host: str
    port: int
    is_dns: bool

    @classmethod
    def parse(cls, spec: str) -> WorkerSpec:
        """Parse `host:port`, `[v6]:port` or `dns:///name:port`; raises ValueError naming the problem."""
        is_dns = spec.startswith(DNS_PREFIX)
        rest = spec[len(DNS_PREFIX) :] if is_dns else spec
        host, sep, port_text = rest.rpartition(":")
        if not sep or not host:
            raise ValueError(f"worker address {spec!r} must be host:port or {DNS_PREFIX}name:port")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"worker address {spec!r} has no valid port")
        if is_dns and ("/" in host or not host):
            raise ValueError(
                f"worker address {spec!r}: {DNS_PREFIX} takes a name and port, e.g. "
                f"{DNS_PREFIX}tandem-prefill-headless:30001"
            )
        return cls(host=host, port=int(port_text), is_dns=is_dns)

    @property
    def address(self) -> str:
        """The spec as a gRPC target (meaningful for static specs)."""
        return format_address(self.host, self.port)


def format_address(host: str, port: int) -> str:
    """`host:port`, with an IPv6 literal in brackets as gRPC targets want it."""
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    return f"[{host}]:{port}" if is_v6 else f"{host}:{port}"


def check_worker_spec(spec: str) -> str:
    """argparse `type=` for `--prefill`/`--decode`: the value unchanged if it parses."""
    try:
        WorkerSpec.parse(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


async def resolve_all(host: str, port: int) -> tuple[str, ...]:
    """Every address `host` resolves to, as sorted, de-duplicated gRPC targets (`ip:port`, `[v6]:port`).

    Raises `socket.gaierror` when the resolver fails; its `errno` tells "no such name" from the rest.
    """
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return tuple(sorted({format_address(str(info[4][0]), port) for info in infos}))


class RoleDiscovery:
    """The worker addresses of one role, from its specs; DNS specs re-resolved at most every `refresh_interval_s`.

    Not thread-safe; call from one asyncio task (the pool's poller).
    """

    def __init__(
        self,
        role: str,
        specs: Sequence[str],
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if refresh_interval_s <= 0:
            raise ValueError("refresh_interval_s must be positive")
        self.role = role
        self.specs = tuple(WorkerSpec.parse(s) for s in specs)
        self._refresh_interval_s = refresh_interval_s
        self._clock = clock
        self._next_refresh = float("-inf")
        self._resolved: dict[WorkerSpec, tuple[str, ...]] = {s: () for s in self.specs if s.is_dns}

    @property
    def has_dns(self) -> bool:
        return bool(self._resolved)

    @property
    def static_addresses(self) -> tuple[str, ...]:
        return tuple(s.address for s in self.specs if not s.is_dns)

    def addresses(self) -> tuple[str, ...]:
        """The current addresses (static first, then resolved, duplicates dropped), as of the last refresh."""
        found = [*self.static_addresses, *(a for s in self.specs if s.is_dns for a in self._resolved[s])]
        return tuple(dict.fromkeys(found))

    async def refresh(self, force: bool = False) -> tuple[str, ...]:
        """Re-resolve the DNS specs if the interval has passed (or `force`); return `addresses()`."""
        now = self._clock()
        if self.has_dns and (force or now >= self._next_refresh):
            self._next_refresh = now + self._refresh_interval_s
            for spec in self._resolved:
                self._resolved[spec] = await self._resolve(spec)
        return self.addresses()

    async def _resolve(self, spec: WorkerSpec) -> tuple[str, ...]:
        try:
            found = await resolve_all(spec.host, spec.port)
        except socket.gaierror as exc:
            if exc.errno in _NO_SUCH_NAME:
                found = ()
            else:
                logger.warning(
                    "cannot resolve %s worker name %s (%s); keeping its %d last addresses",
                    self.role,
                    spec.host,
                    exc,
                    len(self._resolved[spec]),
                )
                return self._resolved[spec]
        if found != self._resolved[spec]:
            logger.info("%s workers behind %s: %s", self.role, spec.host, ", ".join(found) or "none")
        return found
