"""Credentials of the internal plane: the token (and optional mTLS) the gateway and workers share.

Every `tandem.v1` RPC, reflection included, must carry `authorization: Bearer <token>`; the workers'
server interceptor compares it in constant time and answers UNAUTHENTICATED otherwise. The gRPC
health service stays open, so probes need no secret. With TLS files set, the port is TLS and, with
a CA, the server demands a client certificate signed by it (mTLS); the token is checked as well.

Both sides build their ends here: workers `add_port` + `server_interceptors`, the gateway and tests
`open_channel` (asyncio) or `metadata()` for a plain call.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

logger = logging.getLogger(__name__)

# Unauthenticated on purpose: Kubernetes and compose probes carry no secret.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
_HEADER = "authorization"
MIN_TOKEN_LEN = 16


def generate_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def read_token_file(path: str, what: str = "internal token") -> str:
    """The token (or other secret, named by `what`) a file holds, surrounding whitespace stripped;
    ValueError when it is empty."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"the {what} file {path} is empty")
    return token


def write_token_file(path: str) -> bool:
    """Write a fresh token to `path` (mode 0600, parents created) unless it already holds one;
    True when it wrote."""
    file = Path(path)
    if file.is_file() and file.read_text().strip():
        return False
    file.parent.mkdir(parents=True, exist_ok=True)
    file.touch(mode=0o600)
    file.chmod(0o600)
    file.write_text(generate_token() + "\n")
    return True


@dataclass(frozen=True, slots=True)
class InternalCredentials:
    """The shared token, and TLS files (paths) for deployments that want mTLS. All None: an open
    plane, allowed only on loopback (the launcher enforces that) or with --insecure."""

    token: str | None = field(default=None, repr=False)  # kept out of logs and reprs
    tls_cert: str | None = None  # this process's certificate chain (PEM)
    tls_key: str | None = None  # its private key (PEM)
    tls_ca: str | None = None  # the CA that signs every peer's certificate (PEM)

    def __post_init__(self) -> None:
        if self.token is not None and len(self.token) < MIN_TOKEN_LEN:
            raise ValueError(f"the internal token must be at least {MIN_TOKEN_LEN} characters")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key: mTLS means both sides present one")
        for path in (self.tls_cert, self.tls_key, self.tls_ca):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file not found: {path}")

    @property
    def has_tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def is_open(self) -> bool:
        """No token and no client certificate check: anyone who reaches the port may call."""
        return self.token is None and self.tls_ca is None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata that carries the token (empty without one)."""
        return ((_HEADER, f"Bearer {self.token}"),) if self.token else ()

    # --- the server side -------------------------------------------------------------------

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on `address`: TLS (client certificates required when a CA is set) or plaintext.
        Returns the bound port (0 on failure, as grpc does)."""
        if not self.has_tls:
            return server.add_insecure_port(address)
        credentials = grpc.ssl_server_credentials(
            [(_read(self.tls_key), _read(self.tls_cert))],
            root_certificates=_read(self.tls_ca) if self.tls_ca else None,
            require_client_auth=self.tls_ca is not None,
        )
        return server.add_secure_port(address, credentials)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenCheck(self.token)] if self.token else []

    # --- the client side -------------------------------------------------------------------

    def open_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to a worker that sends the token with every call."""
        interceptors = _token_interceptors(self.metadata()) if self.token else None
        if not self.has_tls:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(address, self._channel_credentials(), options=options, interceptors=interceptors)

    def open_sync_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel (health checks, tests); pass `metadata()` with each call."""
        if not self.has_tls:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self._channel_credentials(), options=options)

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca) if self.tls_ca else None,
            private_key=_read(self.tls_key),
            certificate_chain=_read(self.tls_cert),
        )


def _read(path: str | None) -> bytes:
    assert path is not None  # callers check has_tls / tls_ca first
    return Path(path).read_bytes()


class TokenCheck(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call (health excepted) without exactly one `authorization: Bearer
    <token>` entry; the comparison takes the same time whatever the caller sent."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        if details.method.startswith(OPEN_METHOD_PREFIXES) or self._is_allowed(details.invocation_metadata):
            return await continuation(details)
        logger.warning("refused %s: missing or wrong internal token", details.method)
        handler = await continuation(details)
        return _refusing_handler(handler)

    def _is_allowed(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        given = [value for key, value in metadata or () if key == _HEADER]
        if len(given) != 1:
            return False
        value = given[0].encode() if isinstance(given[0], str) else given[0]
        return hmac.compare_digest(value, self._expected)


_REFUSAL = "this worker needs the cluster's internal token (--internal-token) with every call"


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)


async def _refuse_stream(request: Any, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
    yield  # never reached: makes this an async generator, as streaming handlers are


def _refusing_handler(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` (unknown methods: unary) that only refuses."""
    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(_refuse)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    return grpc.unary_stream_rpc_method_handler(_refuse_stream)


class _AddToken:
    """Adds the token to a call's metadata. grpc.aio files each interceptor under the first call shape
    it matches, so each shape gets its own subclass (`_token_interceptors`)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _AddTokenUnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _AddTokenUnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _AddTokenStreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._with_token(details), request_iterator)


class _AddTokenStreamStream(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._with_token(details), request_iterator)


def _token_interceptors(metadata: tuple[tuple[str, str], ...]) -> list[grpc.aio.ClientInterceptor]:
    return [
        cls(metadata)
        for cls in (_AddTokenUnaryUnary, _AddTokenUnaryStream, _AddTokenStreamUnary, _AddTokenStreamStream)
    ]


def is_loopback_host(host: str) -> bool:
    """True when `host` (a name or address, maybe `[v6]`) names only this machine's loopback."""
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def host_of(address: str) -> str:
    """The host part of a `host:port`, `[v6]:port` or `dns:///host:port` worker address."""
    address = address.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    if address.startswith("["):
        return address[1 : address.index("]")]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address
