"""API keys as both fronts check them: the HTTP middleware (`gateway/api/auth.py`) and the gRPC API's
interceptor (`gateway/grpc_api/server.py`) compare a caller's `Authorization` value with these."""

from __future__ import annotations

import hmac


def bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def matches_any(given: bytes, accepted: tuple[bytes, ...]) -> bool:
    """Compares against every accepted value (no early exit), each in constant time."""
    matches = [hmac.compare_digest(given, value) for value in accepted]
    return any(matches)
