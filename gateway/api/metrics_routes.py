"""The gateway's HTTP metrics: `MetricsMiddleware` counts every request, `GET /metrics` serves the
Prometheus text of the app's `GatewayMetrics` (`gateway/metrics.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.api.app_state import gateway_state
from gateway.metrics import GatewayMetrics

router = APIRouter()

_UNMATCHED_ROUTE = "unmatched"  # 404s and anything no route claimed: one label, whatever the path


class MetricsMiddleware:
    """ASGI middleware: counts each HTTP request once its response ends, labelled with the route
    template that matched (`/v1/files/{file_id}`, never the raw path) and the status sent (500 when
    the app raised before answering). Must sit inside any middleware that copies the scope, so that
    it sees the route the router recorded there."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.requests_in_flight.inc()
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.requests_in_flight.dec()
            route = getattr(scope.get("route"), "path", _UNMATCHED_ROUTE)
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()


@router.get("/metrics")
async def prometheus_text(request: Request) -> Response:
    """Prometheus text of this gateway (each worker serves its own on its --metrics-port)."""
    return Response(gateway_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
