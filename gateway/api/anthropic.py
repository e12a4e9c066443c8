"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

Thin routes: the body becomes a chat completion request (anthropic_convert.py), runs through the
chat route's own operation (chat.py) and comes back as a Message or its events (anthropic_stream.py).
Every error these routes answer, a refused body included, is in Anthropic's shape (anthropic_errors.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.api.anthropic_errors import api_error_response, error_body, validation_error_response
from gateway.api.anthropic_stream import events_response, message_events
from gateway.api.app_state import gateway_state
from gateway.api.body_limit import BodyTooLarge
from gateway.api.disconnect import disconnect_guard
from gateway.api.json_route import JSONRoute
from gateway.errors import APIError
from gateway.service.anthropic_convert import chat_request, message
from gateway.service.anthropic_schemas import CountTokensRequest, Message, MessagesRequest, TokenCount, message_id
from gateway.service.chat import chat_prompt_ids, complete_chat
from gateway.service.response_schemas import ChatCompletion
from gateway.service.state import GatewayState

logger = logging.getLogger(__name__)


class AnthropicRoute(JSONRoute):
    """A JSON route whose errors (validation, APIError, HTTP errors, the unexpected) answer in
    Anthropic's shape, not the app-wide OpenAI one."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def answered(request: Request) -> Response:
            try:
                return await handle(request)
            except RequestValidationError as exc:
                return validation_error_response(exc)
            except APIError as exc:
                return api_error_response(exc)
            except StarletteHTTPException as exc:
                headers = {"Connection": "close"} if isinstance(exc, BodyTooLarge) else None
                body = error_body(exc.status_code, str(exc.detail))
                return JSONResponse(body, status_code=exc.status_code, headers=headers)
            except Exception:
                logger.exception("unhandled error on %s", request.url.path)
                return JSONResponse(error_body(500, "internal server error"), status_code=500)

        return answered


router = APIRouter(route_class=AnthropicRoute)


@router.post("/v1/messages", response_model=Message)
async def create_message(body: MessagesRequest, http_request: Request, state: GatewayState = Depends(gateway_state)):
    chat = chat_request(body)
    prompt_ids, plan = await chat_prompt_ids(state, chat)
    answer = await complete_chat(state, chat, disconnect_guard(http_request), prompt_ids, plan)
    if isinstance(answer, ChatCompletion):
        return message(answer, body.model, message_id(), body.stop_sequences)
    return events_response(message_events(answer, body.model, message_id(), len(prompt_ids), body.stop_sequences))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, state: GatewayState = Depends(gateway_state)) -> TokenCount:
    prompt_ids, _ = await chat_prompt_ids(state, chat_request(body))
    return TokenCount(input_tokens=len(prompt_ids))
