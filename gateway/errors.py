"""Gateway errors: `APIError`, answered as an OpenAI error body with its HTTP status.

No error body names an internal address, a filesystem path or an exception class. A failed call to
a worker becomes an `APIError` in one place, `gateway/cluster/worker_errors.py` (the gRPC status table:
the worker's role in the body, its address in the log); `public_message` scrubs every body once more.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

from pydantic import ValidationError

logger = logging.getLogger(__name__)

# A worker that went away (a crash, a restart, a drain) is usually back, or replaced, within seconds:
# the Retry-After of every 503 about a worker.
WORKER_RETRY_AFTER_S = 1

_ADDRESS = re.compile(
    r"\[[0-9A-Fa-f:.]*::[0-9A-Fa-f:.]*\](?::\d{1,5})?"  # [::1], [fe80::1]:31002 (not [19:08:57])
    r"|\[(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}\](?::\d{1,5})?|\[[0-9A-Fa-f:.]+\]:\d{1,5}"
    r"|\b(?:ipv4|ipv6|dns|unix|unix-abstract):[^\s,;'\")]+"  # gRPC target and peer names
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"  # 10.0.0.7, 127.0.0.1:31002
    r"|\b[A-Za-z][\w.-]*:\d{2,5}\b"
)  # localhost:31002, decode-0.tandem:31002
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
    text = _PATH.sub("<path>", text)  # first: `file.cc:83` is a path's line, not a host and port
    text = _ADDRESS.sub("<address>", text)
    text = _EXCEPTION.sub("", text)
    return _EXCEPTION_REPR.sub(r"\2", text)


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`, and a
    `Retry-After` header when `retry_after_s` is set (503s of an overloaded gateway)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
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
        return {
            "error": {
                "message": message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, "invalid_request_error", param, code)


def context_length_exceeded(
    context_len: int, prompt_len: int, max_new_tokens: int | None, param: str = "prompt"
) -> APIError:
    if max_new_tokens is None:
        message = (
            f"This model's maximum context length is {context_len} tokens. However, your prompt has "
            f"{prompt_len} tokens, leaving no room for a completion."
        )
    else:
        message = (
            f"This model's maximum context length is {context_len} tokens. However, you requested "
            f"{prompt_len + max_new_tokens} tokens ({prompt_len} in the prompt, {max_new_tokens} in the "
            f"completion). Please reduce the prompt or the completion length."
        )
    return bad_request(message, param=param, code="context_length_exceeded")


def validation_error(exc: ValidationError) -> APIError:
    """A body whose values the API's record refuses (a gRPC request, a batch line): the HTTP route's
    400, naming the field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    param = ".".join(str(part) for part in errors[0]["loc"]) or None
    message = errors[0]["msg"]
    return APIError(400, f"{param}: {message}" if param else message, param=param)
