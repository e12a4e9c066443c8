"""vLLM's scoring routes: /score and /v1/score (text pairs), /rerank, /v1/rerank and /v2/rerank
(documents against a query, Jina and Cohere style). Each parses its body, calls the scoring service
(`gateway/service/scoring.py`: a cross-encoder's sigmoid or an embedding model's cosine) and writes
vLLM's answer; `score_answer` and `rerank_answer` are also the gRPC API's Score and Rerank."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from gateway.api.app_state import gateway_state
from gateway.api.json_route import JSONRoute
from gateway.service.request_schemas import RerankRequest, ScoreRequest
from gateway.service.scoring import rerank_answer, score_answer
from gateway.service.state import GatewayState

router = APIRouter(route_class=JSONRoute)


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, state: GatewayState = Depends(gateway_state)) -> dict[str, Any]:
    return await score_answer(state, body)


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, state: GatewayState = Depends(gateway_state)) -> dict[str, Any]:
    return await rerank_answer(state, body)
