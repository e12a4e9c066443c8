"""The one table from a failed gRPC call to a worker to the HTTP error the client sees.

`WorkerClient` (`gateway/cluster/client.py`) is the only caller: every RPC's failure passes through
`worker_error` once. The body names the worker's role only, never its address: the address and the
worker's full answer go to the log (under the request id). 503s carry `Retry-After`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from gateway.errors import WORKER_RETRY_AFTER_S, APIError, public_message
from gateway.records import Role
from tandem.request_log import NO_REQUEST, current_request_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ErrorKind:
    http_status: int
    type: str
    code: str | None = None


# gRPC status -> how the HTTP client sees it.
HTTP_OF_GRPC: dict[grpc.StatusCode, ErrorKind] = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind(400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: ErrorKind(400, "invalid_request_error", "context_length_exceeded"),
    grpc.StatusCode.FAILED_PRECONDITION: ErrorKind(400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: ErrorKind(404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorKind(503, "server_overloaded", "capacity_exceeded"),
    grpc.StatusCode.UNAVAILABLE: ErrorKind(503, "service_unavailable", "worker_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind(504, "timeout_error", "timeout"),
    grpc.StatusCode.ABORTED: ErrorKind(503, "service_unavailable", "aborted"),
    grpc.StatusCode.CANCELLED: ErrorKind(503, "service_unavailable", "cancelled"),
    # The model failed on this request alone (non-finite logits); the worker's message says so.
    grpc.StatusCode.DATA_LOSS: ErrorKind(500, "internal_error", "internal_error"),
}
_INTERNAL = ErrorKind(500, "internal_error")

# Codes whose details gRPC's client side may write ("failed to connect to all addresses; ... ipv4:...")
# get a fixed line instead, as do the codes mapped to _INTERNAL (an exception the worker did not expect
# reads "Unexpected <class ...>: ...").
_FIXED_MESSAGE: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.UNAVAILABLE: "the {role} worker is unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the {role} worker did not answer in time",
    grpc.StatusCode.CANCELLED: "the call to the {role} worker was cancelled",
}
_INTERNAL_MESSAGE = "the {role} worker failed"

# Codes the client side can raise on its own (deadline, cancel, lost connection): the call may
# still be running on the worker then.
_UNSETTLED_CODES = frozenset(
    {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN}
)


class WorkerError(APIError):
    """A failed call to a worker, answered to the HTTP client as an `APIError`. For the gateway
    itself it also keeps `detail`, the worker's full answer (for the log and the admin views, never
    an error body), and `is_settled`: False when the code is one the client side can raise on its
    own (deadline, cancel, a lost connection, unknown), so the call may still be running on the worker."""

    def __init__(self, kind: ErrorKind, message: str, detail: str, is_settled: bool) -> None:
        super().__init__(
            kind.http_status,
            message,
            kind.type,
            code=kind.code,
            retry_after_s=WORKER_RETRY_AFTER_S if kind.http_status == 503 else None,
        )
        self.detail = detail
        self.is_settled = is_settled


def worker_error(exc: grpc.aio.AioRpcError, role: Role, address: str) -> WorkerError:
    """The HTTP error for a failed call to the `role` worker at `address`; a 503 carries
    Retry-After. The address and the worker's full answer go to the log only."""
    kind = HTTP_OF_GRPC.get(exc.code(), _INTERNAL)
    detail = exc.details() or exc.code().name
    is_settled = exc.code() not in _UNSETTLED_CODES
    log = logger.warning if kind.http_status >= 500 else logger.info
    log("%s worker %s answered %s: %s", role, address, exc.code().name, detail)
    if kind.http_status < 500:  # the worker's words about the request itself
        return WorkerError(kind, public_message(detail), detail, is_settled)
    fixed = _INTERNAL_MESSAGE if kind is _INTERNAL else _FIXED_MESSAGE.get(exc.code())
    if fixed is None:  # capacity, aborted: the worker's own message says why
        return WorkerError(kind, f"the {role} worker: {public_message(detail)}", detail, is_settled)
    request_id = current_request_id()
    where = f" (request {request_id}; details in the gateway log)" if request_id != NO_REQUEST else ""
    return WorkerError(kind, fixed.format(role=role) + where, detail, is_settled)
