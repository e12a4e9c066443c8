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


# Codes that say the worker itself failed (unreachable, refused, reset, draining), not the request:
# the gateway may send the request to another worker instead. A worker never cancels a call on purpose;
# a call that reaches its server as it stops (a drained worker, the moment its requests are done) is
# cancelled by gRPC (the gateway's own cancel raises asyncio.CancelledError, never this code).
_WORKER_FAILURE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
_STALLED = ErrorKind(503, "service_unavailable", "worker_stalled")


class WorkerError(APIError):
    """A failed call to a worker, answered to the HTTP client as an `APIError`. For the gateway
    itself it also keeps `detail`, the worker's full answer (for the log and the admin views, never
    an error body), `is_settled`: False when the code is one the client side can raise on its
    own (deadline, cancel, a lost connection, unknown), so the call may still be running on the worker,
    and `is_worker_failure`: the worker failed (unreachable, refused, reset, draining, stalled), not the
    request, so another worker may serve it. `address` names the worker, for the gateway alone."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        detail: str,
        is_settled: bool,
        address: str = "",
        is_worker_failure: bool = False,
    ) -> None:
        super().__init__(
            kind.http_status,
            message,
            kind.type,
            code=kind.code,
            retry_after_s=WORKER_RETRY_AFTER_S if kind.http_status == 503 else None,
        )
        self.detail = detail
        self.is_settled = is_settled
        self.address = address
        self.is_worker_failure = is_worker_failure


def stalled_error(role: Role, address: str, stall_timeout_s: float) -> WorkerError:
    """A call that got nothing for `stall_timeout_s` from a worker that no longer answers health checks."""
    return WorkerError(
        _STALLED,
        f"the {role} worker stopped responding (nothing for {stall_timeout_s:g} s)",
        f"no answer for {stall_timeout_s:g} s and no answer to a health check",
        is_settled=False,
        address=address,
        is_worker_failure=True,
    )


def worker_error(exc: grpc.aio.AioRpcError, role: Role, address: str) -> WorkerError:
    """The HTTP error for a failed call to the `role` worker at `address`; a 503 carries
    Retry-After. The address and the worker's full answer go to the log only."""
    kind = HTTP_OF_GRPC.get(exc.code(), _INTERNAL)
    detail = exc.details() or exc.code().name
    is_settled, is_failure = exc.code() not in _UNSETTLED_CODES, exc.code() in _WORKER_FAILURE_CODES

    def error(message: str) -> WorkerError:
        return WorkerError(kind, message, detail, is_settled, address, is_failure)

    log = logger.warning if kind.http_status >= 500 else logger.info
    log("%s worker %s answered %s: %s", role, address, exc.code().name, detail)
    if kind.http_status < 500:  # the worker's words about the request itself
        return error(public_message(detail))
    fixed = _INTERNAL_MESSAGE if kind is _INTERNAL else _FIXED_MESSAGE.get(exc.code())
    if fixed is None:  # capacity, aborted: the worker's own message says why
        return error(f"the {role} worker: {public_message(detail)}")
    request_id = current_request_id()
    where = f" (request {request_id}; details in the gateway log)" if request_id != NO_REQUEST else ""
    return error(fixed.format(role=role) + where)
