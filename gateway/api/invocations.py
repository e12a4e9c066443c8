"""SageMaker's /invocations, as vLLM serves it: one route taking the body of another, told apart by
its fields, in vLLM's order: `messages` is a chat completion, `prompt` a text completion, `input`
embeddings, `text_1` and `text_2` a score, `query` and `documents` a rerank. The answer is that
route's own (streamed when it streams); a body none of them takes is a 400 listing the fields."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from gateway.api import embeddings, openai, scoring
from gateway.api.app_state import gateway_state
from gateway.api.json_route import JSONRoute
from gateway.errors import bad_request
from gateway.service.request_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from gateway.service.state import GatewayState

router = APIRouter(route_class=JSONRoute)

Handler = Callable[[Any, Request, GatewayState], Awaitable[Any]]

# (fields that mark the body, its record, the route answering it), first match wins.
_ROUTES: tuple[tuple[tuple[str, ...], type[BaseModel], Handler], ...] = (
    (("messages",), ChatCompletionRequest, openai.chat_completions),
    (("prompt",), CompletionRequest, openai.completions),
    (("input",), EmbeddingRequest, lambda body, _, state: embeddings.create_embeddings(body, state)),
    (("text_1", "text_2"), ScoreRequest, lambda body, _, state: scoring.score(body, state)),
    (("query", "documents"), RerankRequest, lambda body, _, state: scoring.rerank(body, state)),
)


@router.post("/invocations")
async def invocations(
    http_request: Request, body: dict[str, Any] = Body(...), state: GatewayState = Depends(gateway_state)
):
    for fields, record, handler in _ROUTES:
        if all(field in body for field in fields):
            try:
                parsed = record.model_validate(body)
            except ValidationError as exc:
                raise RequestValidationError(exc.errors()) from None
            return await handler(parsed, http_request, state)
    marks = ", ".join(" and ".join(f"`{f}`" for f in fields) for fields, _, _ in _ROUTES)
    raise bad_request(f"/invocations cannot tell which request this is: the body needs one of {marks}", None)
