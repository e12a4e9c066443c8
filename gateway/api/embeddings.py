"""Embedding routes: OpenAI's /v1/embeddings, SGLang's native /encode and /classify, vLLM's /pooling
(the operations are `gateway/service/embeddings.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from gateway.api.app_state import gateway_state
from gateway.api.json_route import JSONRoute
from gateway.service.embeddings import embeddings_answer, encode_answer, pooling_answer
from gateway.service.request_schemas import EmbeddingRequest, EncodeRequest, PoolingRequest
from gateway.service.state import GatewayState

router = APIRouter(route_class=JSONRoute)


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, state: GatewayState = Depends(gateway_state)) -> JSONResponse:
    return JSONResponse(await embeddings_answer(state, body))


@router.post("/pooling")
async def pooling(body: PoolingRequest, state: GatewayState = Depends(gateway_state)) -> JSONResponse:
    return JSONResponse(await pooling_answer(state, body))


@router.post("/encode")
async def encode(body: EncodeRequest, state: GatewayState = Depends(gateway_state)) -> JSONResponse:
    """SGLang's shape: `{"embedding", "meta_info"}` for one input, a list of them for a list."""
    return JSONResponse(await encode_answer(state, body, "/encode"))


@router.post("/classify")
async def classify(body: EncodeRequest, state: GatewayState = Depends(gateway_state)) -> JSONResponse:
    """SGLang's reward-model route: the body and answer of /encode, where a classifier's (e.g.
    `LlamaForSequenceClassification`) "embedding" is its `num_labels` scores for the input's last token."""
    return JSONResponse(await encode_answer(state, body, "/classify"))
