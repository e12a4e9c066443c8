"""Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, for the Messages routes.

Anthropic's body has no `param`, so the message names the bad field. The status stays the gateway's
own (gateway/errors.py and the worker error table); only the body's words change.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from gateway.errors import APIError, public_message

logger = logging.getLogger(__name__)

MESSAGES_PATH_PREFIX = "/v1/messages"

# HTTP status -> Anthropic's error type; any other 4xx is an invalid request, any other 5xx an api_error.
_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# The chat route's parameter names (the Messages request runs through it) -> the Messages request's own.
_PARAMS = {
    "stop": "stop_sequences",
    "max_completion_tokens": "max_tokens",
    "user": "metadata.user_id",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH_PREFIX or path.startswith(MESSAGES_PATH_PREFIX + "/")


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    """The body of an error answered with `status`; the message goes through `public_message`."""
    public = public_message(message)
    if public != message:
        logger.warning("error answered as %r; in full: %s", public, message)
    return {"type": "error", "error": {"type": error_type(status), "message": public}}


def api_error_body(exc: APIError) -> dict[str, Any]:
    """`exc` in Anthropic's shape, its message prefixed with the Messages request's name of its param."""
    param = _PARAMS.get(exc.param, exc.param) if exc.param else None
    message = exc.message
    if exc.param and exc.param != param:
        message = message.replace(f"`{exc.param}`", f"`{param}`")
    if param and param not in message:
        message = f"{param}: {message}"
    return error_body(exc.status, message)


def api_error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(api_error_body(exc), status_code=exc.status, headers=exc.headers)


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """A 400 naming the field pydantic refused (the deepest one, when a union tried several shapes)."""
    errors = exc.errors()
    if not errors:
        return JSONResponse(error_body(400, "invalid request body"), status_code=400)
    if errors[0].get("type") == "json_invalid":
        reason = (errors[0].get("ctx") or {}).get("error", "invalid JSON")
        return JSONResponse(error_body(400, f"the request body is not valid JSON: {reason}"), status_code=400)
    deepest = max(errors, key=lambda e: len(e.get("loc", ())))
    field = ".".join(str(p) for p in deepest.get("loc", ()) if p != "body" and not _is_union_label(p))
    message = deepest.get("msg", "invalid value")
    return JSONResponse(error_body(400, f"{field}: {message}" if field else message), status_code=400)


def _is_union_label(part: object) -> bool:
    """pydantic names the union member it tried in an error's location (`str`, `list[...]`): not a field."""
    return isinstance(part, str) and (part == "str" or "[" in part)
