"""A request body size limit that answers 413 with an OpenAI error body, without reading the body.

A body whose Content-Length is over the limit is refused before a byte of it is read; a chunked
body is counted as it arrives and refused as soon as it passes the limit. (Starlette's own limit
answers in plain text and replaces any response of ours, hence this one.)
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a body passes its limit. FastAPI passes an HTTPException raised
    while it reads a body on to the app's handlers (gateway/app.py answers it with `body()`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this route's limit of {limit} bytes")

    def body(self) -> dict:
        return APIError(413, str(self.detail), code="request_too_large").body()


class BodyLimitMiddleware:
    """At most `max_bytes` of body per request; `route_limits` maps exact paths to their own limit."""

    def __init__(self, app: ASGIApp, max_bytes: int, route_limits: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.route_limits = dict(route_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.route_limits.get(scope["path"], self.max_bytes)
        if _content_length(scope) > limit:
            error = BodyTooLarge(limit)
            await JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)
            return
        num_bytes = 0

        async def counted() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0  # the server refuses a malformed length itself
    return 0
