"""vLLM's scoring routes: /score and /v1/score (text pairs), /rerank, /v1/rerank and /v2/rerank
(documents against a query, Jina and Cohere style). Each parses its body, calls the scoring service
(`gateway/service/scoring.py`: a cross-encoder's sigmoid or an embedding model's cosine) and writes
vLLM's answer; `score_answer` and `rerank_answer` are also the gRPC API's Score and Rerank."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends

from gateway.api.json_route import JSONRoute
from gateway.api.schemas import RerankRequest, ScoreRequest
from gateway.service.scoring import check_top_n, ranking, score_texts
from gateway.state import GatewayState, gateway_state

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


async def score_answer(state: GatewayState, body: ScoreRequest) -> dict[str, Any]:
    """vLLM's ScoreResponse: one score per pair, in text_2's order."""
    model = _model(state, body.model)
    scores = await score_texts(
        state.pooling_workers(),
        state.require_tokenizer("text_1"),
        body.firsts(),
        body.seconds(),
        "/score",
        ("text_1", "text_2"),
        body.use_activation is not False,
    )
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": value} for i, value in enumerate(scores.values)],
        "usage": {"prompt_tokens": scores.num_tokens, "total_tokens": scores.num_tokens, "completion_tokens": 0},
    }


async def rerank_answer(state: GatewayState, body: RerankRequest) -> dict[str, Any]:
    """vLLM's RerankResponse: the documents best first, the first `top_n` of them when it is positive."""
    model = _model(state, body.model)
    check_top_n(body.top_n)
    texts = body.document_texts()
    scores = await score_texts(
        state.pooling_workers(),
        state.require_tokenizer("query"),
        [body.query],
        texts,
        "/rerank",
        ("query", "documents"),
        body.use_activation is not False,
    )
    results = []
    for index in ranking(scores.values, body.top_n):
        result: dict[str, Any] = {"index": index, "relevance_score": scores.values[index]}
        if body.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    usage = {"prompt_tokens": scores.num_tokens, "total_tokens": scores.num_tokens}
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": usage, "results": results}


def _model(state: GatewayState, model: str | None) -> str:
    """The answer's `model`: the request's, once checked, else the served name."""
    if model is None:
        return state.config.served_model_name
    state.check_model(model)
    return model
