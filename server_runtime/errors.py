"""The one table from engine and transfer errors to gRPC status codes."""

from __future__ import annotations

from typing import NoReturn

import grpc

from engine import errors as e
from kv_transfer import KVTransferError, KVTransferTimeout


class RequestFailedError(e.EngineError):
    """The engine ended this request with FinishReason.ERROR (its own computation went wrong, e.g.
    non-finite logits); the other requests were unaffected."""


class WorkerWithoutLorasError(e.EngineError):
    """A LoRA adapter call to a worker started with no slots for adapters (--max-loras 0)."""


# Most specific first: the first matching class wins.
STATUS_OF_ERROR: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (e.ContextLengthExceededError, grpc.StatusCode.OUT_OF_RANGE),
    (e.InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (e.CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (e.RequestNotFoundError, grpc.StatusCode.NOT_FOUND),
    (e.LoraNotFoundError, grpc.StatusCode.NOT_FOUND),
    (e.LoraInUseError, grpc.StatusCode.FAILED_PRECONDITION),
    (WorkerWithoutLorasError, grpc.StatusCode.FAILED_PRECONDITION),
    (e.RequestAbortedError, grpc.StatusCode.ABORTED),
    (KVTransferTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (KVTransferError, grpc.StatusCode.UNAVAILABLE),
    (e.EngineDeadError, grpc.StatusCode.INTERNAL),
    (RequestFailedError, grpc.StatusCode.DATA_LOSS),
)


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    for cls, code in STATUS_OF_ERROR:
        if isinstance(exc, cls):
            return code
    return None


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the RPC with the status mapped from `exc`; unknown exceptions propagate (INTERNAL)."""
    code = status_for(exc)
    if code is None:
        raise exc
    await context.abort(code, str(exc))
    raise AssertionError("unreachable: ServicerContext.abort raises")  # its stub does not say so
