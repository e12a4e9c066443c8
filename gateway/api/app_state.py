"""The HTTP routes' way to the gateway's state: a FastAPI dependency."""

from __future__ import annotations

from fastapi import Request

from gateway.service.state import GatewayState


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway
