"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models. Each parses its body,
calls the operation every front shares (chat.py, completion.py) and formats its answer."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from gateway.api.app_state import gateway_state
from gateway.api.disconnect import disconnect_guard
from gateway.api.json_route import JSONRoute
from gateway.api.sse import sse_response
from gateway.service.chat import chat_completion
from gateway.service.completion import completion
from gateway.service.model_info import model_card, model_list
from gateway.service.request_schemas import ChatCompletionRequest, CompletionRequest
from gateway.service.response_schemas import ChatCompletion, Completion, ModelCard, ModelList
from gateway.service.state import GatewayState

router = APIRouter(route_class=JSONRoute)


@router.get("/v1/models")
async def list_models(state: GatewayState = Depends(gateway_state)) -> ModelList:
    return model_list(state)


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: GatewayState = Depends(gateway_state)) -> ModelCard:
    return model_card(state, model_id)


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(
    body: ChatCompletionRequest, http_request: Request, state: GatewayState = Depends(gateway_state)
):
    answer = await chat_completion(state, body, disconnect_guard(http_request))
    return answer if isinstance(answer, ChatCompletion) else sse_response(answer)


@router.post("/v1/completions", response_model=Completion)
async def completions(body: CompletionRequest, http_request: Request, state: GatewayState = Depends(gateway_state)):
    answer = await completion(state, body, disconnect_guard(http_request))
    return answer if isinstance(answer, Completion) else sse_response(answer)
