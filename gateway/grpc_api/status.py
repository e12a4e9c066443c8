"""The gateway's errors as gRPC statuses: the code, the message the HTTP body would carry, and rich
details (google.rpc.BadRequest naming the field, ErrorInfo with the HTTP API's error code and status,
RetryInfo where HTTP sends Retry-After). One table, read by every RPC."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from gateway.errors import APIError

_DOMAIN = "tandem.api.v1"

# The HTTP API's error codes whose status is not the HTTP status's.
_CODE_OF_ERROR_CODE = {
    "context_length_exceeded": grpc.StatusCode.OUT_OF_RANGE,
    "queue_full": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "queue_timeout": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "capacity_exceeded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "aborted": grpc.StatusCode.ABORTED,
}
_CODE_OF_HTTP_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def code_of(error: APIError) -> grpc.StatusCode:
    """The gRPC code of an error the HTTP API answers with `error.status`."""
    if error.code in _CODE_OF_ERROR_CODE:
        return _CODE_OF_ERROR_CODE[error.code]
    return _CODE_OF_HTTP_STATUS.get(int(error.status), grpc.StatusCode.INTERNAL)


def status_of(error: APIError) -> grpc.Status:
    """`error` as a status with details; the message is the HTTP body's (scrubbed of internal names)."""
    code = code_of(error)
    body = error.body()["error"]
    # The reason is the HTTP body's code where it has one, else its type.
    reason = error.code if error.code is not None else error.type
    info = error_details_pb2.ErrorInfo(
        reason=reason.upper(), domain=_DOMAIN, metadata={"http_status": str(error.status)}
    )
    details: list[Message] = [info]
    if body["param"] and code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        violation = error_details_pb2.BadRequest.FieldViolation(field=body["param"], description=body["message"])
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    if error.retry_after_s is not None:
        details.append(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=error.retry_after_s)))
    packed = []
    for detail in details:
        any_detail = any_pb2.Any()
        any_detail.Pack(detail)
        packed.append(any_detail)
    status = status_pb2.Status(code=_RPC_CODE[code], message=body["message"], details=packed)
    return rpc_status.to_status(status)


_RPC_CODE = {code: getattr(code_pb2, code.name) for code in grpc.StatusCode}
