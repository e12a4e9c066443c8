"""`tandem healthcheck`: one probe of a worker's gRPC health service or the gateway's HTTP /health.

Made for container health checks (Docker `HEALTHCHECK`, compose `healthcheck`, a Kubernetes
`exec` probe): it prints one line and exits 0 when the target is serving, 1 when it is not or
cannot be reached. It imports neither torch nor the engine, so it starts in well under a second.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass

from tandem.internal_auth import InternalCredentials

DEFAULT_TIMEOUT_S = 3.0


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The outcome of one probe: whether the target serves, and a line saying what was seen."""

    is_healthy: bool
    detail: str


def add_healthcheck_args(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--grpc", metavar="HOST:PORT", help="ask this worker's grpc.health.v1 service (healthy when SERVING)"
    )
    target.add_argument(
        "--http",
        metavar="URL",
        help="GET this URL (healthy on a 2xx answer), e.g. the gateway's http://127.0.0.1:30000/health",
    )
    parser.add_argument(
        "--service", default="", help="gRPC health service name to ask about (default: the server as a whole)"
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds before giving up")
    for flag, what in (("--tls-cert", "certificate chain"), ("--tls-key", "private key"), ("--tls-ca", "CA")):
        parser.add_argument(flag, default=None, help=f"PEM {what}, for a worker whose port speaks (m)TLS")


def probe_grpc(
    address: str,
    service: str = "",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    credentials: InternalCredentials = InternalCredentials(),
) -> ProbeResult:
    """Call `grpc.health.v1.Health/Check` on `address` once, with `timeout_s` as the deadline (health
    needs no token; `credentials` matter only for a TLS port)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with credentials.open_sync_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return ProbeResult(False, f"{address}: {exc.code().name} {exc.details() or ''}".rstrip())
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return ProbeResult(reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}")


def probe_http(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> ProbeResult:
    """GET `url` once; healthy on a 2xx status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return ProbeResult(200 <= response.status < 300, f"{url}: HTTP {response.status}")
    except urllib.error.HTTPError as exc:
        return ProbeResult(False, f"{url}: HTTP {exc.code}")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return ProbeResult(False, f"{url}: {reason}")


def run_healthcheck(args: argparse.Namespace) -> int:
    """Entry point of `tandem healthcheck`: 0 when healthy, 1 otherwise."""
    if args.timeout <= 0:
        raise SystemExit("--timeout must be positive")
    if args.grpc:
        try:
            credentials = InternalCredentials(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca)
        except ValueError as exc:
            raise SystemExit(f"tandem healthcheck: {exc}") from None
        result = probe_grpc(args.grpc, args.service, args.timeout, credentials)
    else:
        result = probe_http(args.http, args.timeout)
    print(
        f"{'healthy' if result.is_healthy else 'unhealthy'}: {result.detail}",
        file=sys.stdout if result.is_healthy else sys.stderr,
    )
    return 0 if result.is_healthy else 1
