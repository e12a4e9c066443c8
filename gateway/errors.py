"""Gateway errors: the one table from gRPC status codes to HTTP status and OpenAI error bodies."""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

import grpc


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
}
_INTERNAL = ErrorKind(500, "internal_error")


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    @classmethod
    def from_grpc(cls, exc: grpc.aio.AioRpcError, worker: str) -> "APIError":
        kind = HTTP_OF_GRPC.get(exc.code(), _INTERNAL)
        detail = exc.details() or exc.code().name
        if kind.http_status >= 500:
            detail = f"{worker}: {detail}"
        return cls(kind.http_status, detail, kind.type, code=kind.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, "invalid_request_error", param, code)


def context_length_exceeded(context_len: int, prompt_len: int, max_new_tokens: int | None,
                            param: str = "prompt") -> APIError:
    if max_new_tokens is None:
        message = (f"This model's maximum context length is {context_len} tokens. However, your prompt has "
                   f"{prompt_len} tokens, leaving no room for a completion.")
    else:
        message = (f"This model's maximum context length is {context_len} tokens. However, you requested "
                   f"{prompt_len + max_new_tokens} tokens ({prompt_len} in the prompt, {max_new_tokens} in the "
                   f"completion). Please reduce the prompt or the completion length.")
    return bad_request(message, param=param, code="context_length_exceeded")
