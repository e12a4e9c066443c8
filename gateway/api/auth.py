"""The public edge: which bearer key each route needs, checked by one ASGI middleware.

Three kinds of route:

- open (`OPEN_PATHS`): liveness probes and the Prometheus scrape; never need a key;
- admin (`ADMIN_PATHS`): routes that change the server's state or show its internals; they need the
  admin key when `--admin-api-key` is set (the user key is not enough), else the user key when
  `--api-key` is set, else nothing;
- every other route: the user key when `--api-key` is set (the admin key opens them too), else nothing.

The key comes as `Authorization: Bearer <key>` or, as Anthropic's clients send it, `x-api-key: <key>`.
A request with more than one `Authorization` or `x-api-key` header, or with both carrying different
keys, is refused (400) before anything else, keys or not: which of two credentials a proxy or the app
would honour is not something to leave to chance. The Messages routes (/v1/messages...) answer these
refusals in Anthropic's error shape.
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from gateway.api.anthropic_errors import api_error_body, is_messages_path
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.service.api_keys import bearer, matches_any
from tandem.internal_auth import is_loopback_host

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})
ADMIN_PATHS = frozenset(
    {
        "/flush_cache",
        "/update_weights_from_disk",
        "/get_server_info",
        "/start_expert_distribution_record",
        "/stop_expert_distribution_record",
        "/dump_expert_distribution_record",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)


class AuthMiddleware:
    """Refuses duplicate `Authorization` headers (400) and requests without the key their route
    needs (401, the same OpenAI error body whichever key was missing). Keys are compared in
    constant time. Must be the outermost middleware."""

    def __init__(self, app, api_key: str | None, admin_api_key: str | None) -> None:
        self.app = app
        user = (bearer(api_key),) if api_key else ()
        admin = (bearer(admin_api_key),) if admin_api_key else ()
        self._user_route_keys = user + admin if user else ()  # no user key: user routes are open
        self._admin_route_keys = admin or user

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = [value for name, value in scope["headers"] if name == b"authorization"]
        api_keys = [value for name, value in scope["headers"] if name == b"x-api-key"]
        if len(given) > 1 or len(api_keys) > 1:
            header = "Authorization" if len(given) > 1 else "x-api-key"
            error = APIError(
                400,
                f"More than one {header} header was sent; send exactly one.",
                param=header,
                code="duplicate_authorization_header",
            )
            await _refuse(error, scope, receive, send)
            return
        if api_keys:
            from_api_key = b"Bearer " + api_keys[0]
            if given and given[0] != from_api_key:
                error = APIError(
                    400,
                    "Authorization and x-api-key carry different keys; send one of them.",
                    param="x-api-key",
                    code="duplicate_authorization_header",
                )
                await _refuse(error, scope, receive, send)
                return
            given = [from_api_key]
        accepted = self._keys_for(scope["path"])
        if accepted and not matches_any(given[0] if given else b"", accepted):
            await _refuse(APIError(401, "Incorrect API key provided.", code="invalid_api_key"), scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _keys_for(self, path: str) -> tuple[bytes, ...]:
        """The `Authorization` values that open `path`; empty when it is open to all."""
        if path in OPEN_PATHS:
            return ()
        return self._admin_route_keys if path in ADMIN_PATHS else self._user_route_keys


async def _refuse(error: APIError, scope, receive, send) -> None:
    """Answer `error` in the shape of the route's API: Anthropic's on the Messages routes, else OpenAI's."""
    body = api_error_body(error) if is_messages_path(scope["path"]) else error.body()
    await JSONResponse(body, status_code=error.status)(scope, receive, send)


def log_key_policy(config: GatewayConfig) -> None:
    """Say at start-up what the keys leave open."""
    if config.api_key and not config.admin_api_key:
        logger.warning(
            "admin routes (%s) share the user API key; set --admin-api-key to give them their own",
            ", ".join(sorted(ADMIN_PATHS)),
        )
    if not config.api_key and not is_loopback_host(config.host):
        what = "every route" if not config.admin_api_key else "every route but the admin routes"
        logger.warning(
            "the gateway listens on %s with no --api-key: anyone who can reach it can use %s", config.host, what
        )
