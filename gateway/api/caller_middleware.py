"""Binds each HTTP request's caller (`gateway/caller.py`: its tenant, whether it is a batch line) for
the handoff to read. A bad tenant header is a 400 naming it, in the route's API's error shape."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from gateway.api.anthropic_errors import api_error_body, is_messages_path
from gateway.caller import bind_caller, caller_from
from gateway.errors import APIError


class CallerMiddleware:
    """ASGI middleware; inside `AuthMiddleware`, so only requests with the key their route needs get here."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = ((name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"])
        try:
            caller = caller_from(headers)
        except APIError as error:
            body = api_error_body(error) if is_messages_path(scope["path"]) else error.body()
            await JSONResponse(body, status_code=error.status)(scope, receive, send)
            return
        bind_caller(caller)
        await self.app(scope, receive, send)
