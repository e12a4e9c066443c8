"""KV write grants: the decode server's signed permission to write one request's reserved pages.

A decode reservation returns its pages with a grant: an HMAC over the request id, the destination
(transport session, pool address), the exact page list and the prompt tokens it skips (those the decode
worker already holds), valid until an expiry. The gateway
forwards it untouched; the prefill server writes only when the grant verifies for the request id
and pages it was sent, once; the decode server admits Generate only with the grant it issued. A
caller who never saw a grant cannot name pages, and one request's grant cannot aim at another's.

The key comes from the KV grant secret the two workers share and the gateway never holds
(--kv-grant-secret-file; `tandem serve` makes one for its workers). The internal token is no use
for it: the gateway holds that, so a key derived from it would let a compromised gateway forge
grants. Without a secret (an open plane, loopback only) the key is public and grants only catch
mistakes, not forgeries.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import dataclass, field

from tandem.v1 import common_pb2

logger = logging.getLogger(__name__)


class GrantError(Exception):
    """A write or Generate whose grant does not hold; the message names no pages or addresses."""


def grant_key(secret: str | None) -> bytes:
    """The HMAC key of grants, from the workers' KV grant secret (None: an open plane's public key)."""
    return hmac.new((secret or "").encode(), b"tandem kv write grant v2", hashlib.sha256).digest()


def store_page_key(secret: str | None) -> bytes:
    """The key the pages a worker puts in the cluster's KV store are signed with (engine/kv_store_tier.py),
    from the same secret: only workers hold it, so neither the store nor the gateway can forge a page."""
    return hmac.new((secret or "").encode(), b"tandem kv store page v1", hashlib.sha256).digest()


def _mac(key: bytes, request_id: str, target: common_pb2.KvTarget) -> str:
    text = "\n".join(
        (
            request_id,
            target.session_id,
            str(target.base_addr),
            ",".join(map(str, target.page_ids)),
            str(target.skip_tokens),
            str(target.grant_expires_unix_ms),
        )
    )
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, request_id: str, target: common_pb2.KvTarget, ttl_s: float) -> None:
    """Fill `target.grant` (and its expiry, `ttl_s` from now) for `request_id`'s pages."""
    target.grant_expires_unix_ms = int((time.time() + ttl_s) * 1000)
    target.grant = _mac(key, request_id, target)


@dataclass(slots=True)
class GrantChecker:
    """The prefill side: verifies each grant and remembers those used until they expire, so a
    replayed one is refused. Touched only from the event loop."""

    key: bytes
    _used: dict[str, int] = field(default_factory=dict)  # grant -> expiry (unix ms)

    def check(self, request_id: str, target: common_pb2.KvTarget) -> None:
        """Raises GrantError unless `target.grant` is the decode server's grant for exactly this
        request id, destination and page list, unexpired and not used before. Consumes it."""
        now_ms = self._verify(request_id, target)
        if target.grant_expires_unix_ms <= now_ms:
            logger.warning("refused a KV write for %s: its grant expired", request_id)
            raise GrantError("the KV target's grant has expired")
        if target.grant in self._used:
            logger.warning("refused a KV write for %s: its grant was already used", request_id)
            raise GrantError("the KV target's grant was already used")
        self._used[target.grant] = target.grant_expires_unix_ms

    def revoke(self, request_id: str, target: common_pb2.KvTarget) -> None:
        """Spend a genuine grant without writing, so no later write can use it (an expired one
        needs nothing more). Raises GrantError if it does not verify."""
        now_ms = self._verify(request_id, target)
        if target.grant_expires_unix_ms > now_ms:
            self._used[target.grant] = target.grant_expires_unix_ms

    def _verify(self, request_id: str, target: common_pb2.KvTarget) -> int:
        """Forget expired grants, check the signature, and return the time (unix ms)."""
        now_ms = int(time.time() * 1000)
        self._used = {g: expiry for g, expiry in self._used.items() if expiry > now_ms}
        expected = _mac(self.key, request_id, target)
        if not target.grant or not hmac.compare_digest(target.grant, expected):
            logger.warning(
                "refused a KV grant for %s: it does not cover the pages it names (forged, another "
                "request's, or signed by a decode worker with another --kv-grant-secret-file)",
                request_id,
            )
            raise GrantError(
                "the KV target's grant is not valid for this request (the prefill and decode "
                "workers must share one KV grant secret)"
            )
        return now_ms


@dataclass(slots=True)
class IssuedGrants:
    """The decode side: the grant each live reservation was issued, checked when Generate comes.
    Touched only from the event loop."""

    key: bytes
    _issued: dict[str, tuple[str, int]] = field(default_factory=dict)  # request id -> (grant, expiry ms)

    def issue(self, request_id: str, target: common_pb2.KvTarget, ttl_s: float) -> None:
        now_ms = int(time.time() * 1000)
        self._issued = {rid: g for rid, g in self._issued.items() if g[1] > now_ms}
        sign(self.key, request_id, target, ttl_s)
        self._issued[request_id] = (target.grant, target.grant_expires_unix_ms)

    def redeem(self, request_id: str, grant: str) -> None:
        """Raises GrantError unless `grant` is the one issued for `request_id`; forgets it on success.
        A wrong grant leaves the reservation alone, so a forged Generate cannot drop a real one."""
        issued = self._issued.get(request_id)
        if issued is None or not hmac.compare_digest(issued[0], grant):
            logger.warning("refused Generate for %s: no reservation with that grant", request_id)
            raise GrantError("no reservation holds this request id and grant")
        del self._issued[request_id]
