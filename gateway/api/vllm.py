"""vLLM's utility routes: /tokenize, /detokenize, /version, /ping."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

import tandem
from gateway.api.app_state import gateway_state
from gateway.api.json_route import JSONRoute
from gateway.api.native import health
from gateway.service.state import GatewayState
from gateway.service.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

router = APIRouter(route_class=JSONRoute)


@router.post("/tokenize")
async def tokenize_route(body: TokenizeRequest, state: GatewayState = Depends(gateway_state)) -> dict[str, Any]:
    return await tokenize(state, body)


@router.post("/detokenize")
async def detokenize_route(body: DetokenizeRequest, state: GatewayState = Depends(gateway_state)) -> dict[str, str]:
    return await detokenize(state, body)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": tandem.version()}


@router.get("/ping")
@router.post("/ping")
async def ping(state: GatewayState = Depends(gateway_state)):
    """Liveness as vLLM answers it: 200 when the stack can serve, 503 otherwise."""
    return await health(state)
