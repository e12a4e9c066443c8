"""SGLang's native routes: /generate (the response shape of SGLang's quick start), /health."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from gateway.api.app_state import gateway_state
from gateway.api.disconnect import disconnect_guard
from gateway.api.json_route import JSONRoute
from gateway.api.sse import sse_response
from gateway.service.native_generate import run_generate
from gateway.service.request_schemas import GenerateRequest
from gateway.service.response_schemas import (
    GenerateResponse,
)
from gateway.service.state import GatewayState

router = APIRouter(route_class=JSONRoute)


@router.get("/health")
async def health(state: GatewayState = Depends(gateway_state)):
    """200 when at least one prefill and one decode worker answer their health check, else 503."""
    if state.pool.is_ready:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable", "workers": _worker_states(state)}, status_code=503)


@router.post("/generate", response_model=GenerateResponse | list[GenerateResponse])
async def generate(body: GenerateRequest, http_request: Request, state: GatewayState = Depends(gateway_state)):
    answer = await run_generate(state, body, disconnect_guard(http_request))
    return sse_response(answer) if isinstance(answer, AsyncIterator) else answer


def _worker_states(state: GatewayState) -> list[dict]:
    """Role, readiness and weights only: /health is open to all, so it names no address
    (/get_server_info does). A prefill and a decode worker pair only when their weights agree."""
    return [{"role": w.role, "ready": w.is_ready, "weights": w.weights_id} for w in state.pool.all_workers()]
