"""Gateway errors: the one table from gRPC status codes to HTTP status and OpenAI error bodies.

No error body names an internal address, a filesystem path or an exception class: `from_grpc` logs
the worker's address and its full answer (under the request id) and hands the client only the worker's
role and, when the worker wrote it, its message; `public_message` scrubs every body once more.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from http import HTTPStatus

import grpc

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
# A worker that went away (a crash, a restart, a drain) is usually back, or replaced, within seconds.
WORKER_RETRY_AFTER_S = 1

# Codes whose details gRPC's client side may write ("failed to connect to all addresses; ... ipv4:...")
# get a fixed line instead, as do the codes mapped to _INTERNAL (an exception the worker did not expect
# reads "Unexpected <class ...>: ...").
_FIXED_MESSAGE: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.UNAVAILABLE: "the {role} worker is unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the {role} worker did not answer in time",
    grpc.StatusCode.CANCELLED: "the call to the {role} worker was cancelled",
}
_INTERNAL_MESSAGE = "the {role} worker failed"

_ADDRESS = re.compile(
    r"\[[0-9A-Fa-f:.]*::[0-9A-Fa-f:.]*\](?::\d{1,5})?"         # [::1], [fe80::1]:31002 (not [19:08:57])
    r"|\[(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}\](?::\d{1,5})?|\[[0-9A-Fa-f:.]+\]:\d{1,5}"
    r"|\b(?:ipv4|ipv6|dns|unix|unix-abstract):[^\s,;'\")]+"  # gRPC target and peer names
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"              # 10.0.0.7, 127.0.0.1:31002
    r"|\b[A-Za-z][\w.-]*:\d{2,5}\b")                          # localhost:31002, decode-0.tandem:31002
# Absolute paths of two segments or more, with a `:line` after them; the API's routes (/v1/...) are no secret.
_PATH = re.compile(r"(?<![\w.~/-])/(?!v1/)[\w.@+~-]+(?:/[\w.@+~-]*)+(?::\d+)*")
_EXCEPTION = re.compile(r"<class '[\w.]+'>:?\s*|Traceback \(most recent call last\)[^\n]*")
_EXCEPTION_REPR = re.compile(r"\b[A-Z]\w*(?:Error|Exception)\((['\"])(.*?)\1\)")


def public_message(text: str, keep: tuple[str, ...] = ()) -> str:
    """`text` with internal addresses, absolute paths and exception reprs replaced, fit for a client.
    Occurrences of the strings in `keep` (what the client itself sent, such as a model path) stay."""
    kept = [k for k in keep if k]
    if kept:
        pieces = re.split("(" + "|".join(re.escape(k) for k in kept) + ")", text)
        return "".join(p if i % 2 else public_message(p) for i, p in enumerate(pieces))
    text = _PATH.sub("<path>", text)     # first: `file.cc:83` is a path's line, not a host and port
    text = _ADDRESS.sub("<address>", text)
    text = _EXCEPTION.sub("", text)
    return _EXCEPTION_REPR.sub(r"\2", text)


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`, and a
    `Retry-After` header when `retry_after_s` is set (503s of an overloaded gateway)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None

    def body(self) -> dict:
        """The client's view: the message goes through `public_message` (the full one is logged)."""
        message = public_message(self.message)
        if message != self.message:
            logger.warning("error answered as %r; in full: %s", message, self.message)
        return {"error": {"message": message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    @classmethod
    def from_grpc(cls, exc: grpc.aio.AioRpcError, role: str, address: str) -> "APIError":
        """The HTTP error for a failed call to the `role` worker at `address`; a 503 carries
        Retry-After. The address and the worker's full answer go to the log only."""
        kind = HTTP_OF_GRPC.get(exc.code(), _INTERNAL)
        retry_after_s = WORKER_RETRY_AFTER_S if kind.http_status == 503 else None
        detail = exc.details() or exc.code().name
        log = logger.warning if kind.http_status >= 500 else logger.info
        log("%s worker %s answered %s: %s", role, address, exc.code().name, detail)
        if kind.http_status < 500:    # the worker's words about the request itself
            return cls(kind.http_status, public_message(detail), kind.type, code=kind.code)
        fixed = _INTERNAL_MESSAGE if kind is _INTERNAL else _FIXED_MESSAGE.get(exc.code())
        if fixed is None:             # capacity, aborted: the worker's own message says why
            return cls(kind.http_status, f"the {role} worker: {public_message(detail)}", kind.type, code=kind.code,
                       retry_after_s=retry_after_s)
        request_id = current_request_id()
        where = f" (request {request_id}; details in the gateway log)" if request_id != NO_REQUEST else ""
        return cls(kind.http_status, fixed.format(role=role) + where, kind.type, code=kind.code,
                   retry_after_s=retry_after_s)


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
