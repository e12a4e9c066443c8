"""OpenAI's /v1/responses routes, thin: create, retrieve, delete, cancel, input items; each calls
its operation in `gateway/service/openai_responses.py`."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request

from gateway.api.app_state import gateway_state
from gateway.api.disconnect import disconnect_guard
from gateway.api.json_route import JSONRoute
from gateway.api.sse import event_stream_response
from gateway.errors import APIError, bad_request
from gateway.service import openai_responses
from gateway.service.openai_responses_schemas import (
    CreateResponseRequest,
    DeletedResponse,
    InputItemList,
    ResponseObject,
)
from gateway.service.responses_store import ResponsesService
from gateway.service.state import GatewayState

router = APIRouter(route_class=JSONRoute)

MAX_LIST_LIMIT = 100


def responses_service(request: Request) -> ResponsesService:
    return request.app.state.responses


@router.post("/v1/responses", response_model=ResponseObject)
async def create(
    body: CreateResponseRequest,
    http_request: Request,
    state: GatewayState = Depends(gateway_state),
    service: ResponsesService = Depends(responses_service),
):
    answer = await openai_responses.create_response(state, service, body, disconnect_guard(http_request))
    return answer if isinstance(answer, ResponseObject) else event_stream_response(answer)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject)
async def retrieve(response_id: str, service: ResponsesService = Depends(responses_service)):
    return await openai_responses.retrieve(service, response_id)


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, service: ResponsesService = Depends(responses_service)) -> DeletedResponse:
    await openai_responses.delete(service, response_id)
    return DeletedResponse(id=response_id)


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject)
async def cancel(response_id: str, service: ResponsesService = Depends(responses_service)):
    return await openai_responses.cancel(service, response_id)


@router.get("/v1/responses/{response_id}/input_items", response_model=InputItemList)
async def input_items(
    response_id: str,
    after: str | None = None,
    limit: int = 20,
    order: Literal["asc", "desc"] = "desc",
    service: ResponsesService = Depends(responses_service),
):
    """A page of the response's input context, newest first (`order=asc`: oldest first), after the item `after`."""
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise bad_request(f"limit must be between 1 and {MAX_LIST_LIMIT}, got {limit}", "limit")
    items = await openai_responses.context_items(service, response_id)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.id for item in items]
        if after not in ids:
            raise APIError(404, f"No input item found with id '{after}'.", "invalid_request_error", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return InputItemList(
        data=page,
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
        has_more=len(items) > limit,
    )
