"""OpenAI's Responses API on the chat operation: create (whole, streamed or in the background),
retrieve, delete, cancel and the input items, with `previous_response_id` chains in the data
directory's `ResponseStore`.

A response is a chat completion: its input context (the earlier turn's context and output, then
this turn's input) becomes the chat request `openai_responses_convert.chat_request` makes, run by
`chat.py`'s `chat_prompt_ids` and `complete_chat` like any chat; the answer or its chunks become
the response or its events.
A response is stored (`store`, the default) once it has finished; a background one is stored
queued at once and updated as it runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from pydantic import BaseModel, TypeAdapter

from gateway.errors import APIError, bad_request, public_message
from gateway.service.chat import chat_prompt_ids, complete_chat
from gateway.service.guard import Guard, unguarded
from gateway.service.openai_responses_convert import (
    base_response,
    chat_request,
    finished,
    input_items,
    new_id,
    output_items,
    renamed,
)
from gateway.service.openai_responses_schemas import CreateResponseRequest, Item, ResponseError, ResponseObject
from gateway.service.openai_responses_stream import response_events
from gateway.service.request_schemas import ChatCompletionRequest
from gateway.service.response_schemas import ChatCompletion
from gateway.service.responses_store import (
    UNFINISHED_STATUSES,
    BackgroundResponses,
    ResponseNotFound,
    ResponsesService,
    ResponseStore,
    StoredResponse,
)
from gateway.service.state import GatewayState
from gateway.text.tool_calls import ToolPlan

logger = logging.getLogger(__name__)
_ITEMS = TypeAdapter(list[Item])
_INTERNAL = ResponseError(code="server_error", message="internal server error")
_RESTARTED = ResponseError(code="server_error", message="the gateway restarted before this response finished")


async def create_response(
    state: GatewayState, service: ResponsesService, body: CreateResponseRequest, guard: Guard
) -> ResponseObject | AsyncIterator[BaseModel]:
    """The finished response, its events (`stream`), or (`background`) the queued response."""
    state.resolve_model(body.model)
    state.require_generation()
    if body.background and not body.store:
        raise bad_request("background responses must be stored: store cannot be false", "store")
    if body.background and body.stream:
        raise bad_request("streaming a background response is not supported here", "stream")
    history = await _history(service.store, body.previous_response_id) if body.previous_response_id else []
    items = [*history, *input_items(body)]
    chat_body = chat_request(body, items, stream=body.stream)
    with _renamed_errors():  # the prompt and tools are checked before anything is queued
        prompt = await chat_prompt_ids(state, chat_body)
    response_id = new_id("resp")
    if body.background:
        queued = base_response(body, response_id, "queued")
        await service.store.run(service.store.put, record_of(queued, items))
        work = _run_in_background(state, service.store, chat_body, prompt, queued)
        service.background.start(response_id, work)
        return queued
    base = base_response(body, response_id, "in_progress")
    with _renamed_errors():
        answer = await complete_chat(state, chat_body, guard, *prompt)

    async def save(response: ResponseObject) -> None:
        if body.store:
            await service.store.run(service.store.put, record_of(response, items))

    if not isinstance(answer, ChatCompletion):
        return response_events(base, answer, save)
    response = _from_chat(base, answer)
    await save(response)
    return response


async def retrieve(service: ResponsesService, response_id: str) -> ResponseObject:
    return ResponseObject.model_validate_json((await _stored(service.store, response_id)).response_json)


async def delete(service: ResponsesService, response_id: str) -> None:
    """Forget the response (a background one still running is cancelled first)."""
    await _stored(service.store, response_id)
    await service.background.cancel(response_id)
    with _not_found():
        await service.store.run(service.store.delete, response_id)


async def cancel(service: ResponsesService, response_id: str) -> ResponseObject:
    """A background response still queued or running stops and turns cancelled; a finished one is
    returned as it is. Only background responses can be cancelled (400 otherwise)."""
    response = await retrieve(service, response_id)
    if not response.background:
        raise bad_request("only background responses can be cancelled", "response_id")
    if response.status not in UNFINISHED_STATUSES:
        return response
    await service.background.cancel(response_id)
    cancelled = response.model_copy(update={"status": "cancelled"})
    if await _update_unfinished(service.store, cancelled):
        return cancelled
    return await retrieve(service, response_id)  # it finished before the cancel reached it


async def context_items(service: ResponsesService, response_id: str) -> list[Item]:
    """The response's input context: the earlier turns' items, then its own input."""
    return _ITEMS.validate_json((await _stored(service.store, response_id)).input_items_json)


@contextlib.asynccontextmanager
async def serving_responses(app, data_dir: str | Path) -> AsyncIterator[ResponsesService]:
    """Open the store (responses a former gateway left unfinished turn failed) and set
    `app.state.responses`; on exit cancel the background responses and close the store."""
    store = ResponseStore(data_dir)
    for stored in await store.run(store.unfinished):
        response = ResponseObject.model_validate_json(stored.response_json)
        await _update_unfinished(store, response.model_copy(update={"status": "failed", "error": _RESTARTED}))
    app.state.responses = ResponsesService(store, BackgroundResponses())
    try:
        yield app.state.responses
    finally:
        await app.state.responses.background.close()
        store.close()


async def _run_in_background(
    state: GatewayState,
    store: ResponseStore,
    chat_body: ChatCompletionRequest,
    prompt: tuple[list[int], ToolPlan],
    queued: ResponseObject,
) -> None:
    """Run a queued response to its end; its row is updated only while unfinished (a cancel wins)."""
    await _update_unfinished(store, queued.model_copy(update={"status": "in_progress"}))
    try:
        answer = await complete_chat(state, chat_body, unguarded, *prompt)
        if not isinstance(answer, ChatCompletion):
            raise APIError(500, "a background response cannot stream", "server_error")
        response = _from_chat(queued, answer)
    except APIError as exc:
        error = ResponseError(code=str(exc.code or exc.type), message=public_message(renamed(exc).message))
        response = queued.model_copy(update={"status": "failed", "error": error})
    except Exception:
        logger.exception("background response %s failed", queued.id)
        response = queued.model_copy(update={"status": "failed", "error": _INTERNAL})
    await _update_unfinished(store, response)


def _from_chat(base: ResponseObject, answer: ChatCompletion) -> ResponseObject:
    choice = answer.choices[0]
    finish = str(choice.finish_reason) if choice.finish_reason is not None else None
    return finished(base, output_items(choice.message, finish), finish, answer.usage)


async def _history(store: ResponseStore, previous_id: str) -> list[Item]:
    """The previous response's input context and its output: what the new turn continues."""
    try:
        previous = await store.run(store.get, previous_id)
    except ResponseNotFound:
        raise APIError(
            404,
            f"Previous response with id '{previous_id}' not found.",
            "invalid_request_error",
            "previous_response_id",
            "previous_response_not_found",
        ) from None
    if previous.status in UNFINISHED_STATUSES:
        raise bad_request(f"Previous response '{previous_id}' has not finished yet.", "previous_response_id")
    output = ResponseObject.model_validate_json(previous.response_json).output
    return [*_ITEMS.validate_json(previous.input_items_json), *output]


async def _stored(store: ResponseStore, response_id: str) -> StoredResponse:
    with _not_found():
        return await store.run(store.get, response_id)


@contextlib.contextmanager
def _renamed_errors() -> Iterator[None]:
    try:
        yield
    except APIError as exc:
        raise renamed(exc) from None


@contextlib.contextmanager
def _not_found() -> Iterator[None]:
    try:
        yield
    except ResponseNotFound as exc:
        raise APIError(404, str(exc), "invalid_request_error", "response_id", "response_not_found") from None


async def _update_unfinished(store: ResponseStore, response: ResponseObject) -> bool:
    return await store.run(
        store.update_unfinished, response.id, response.status, response.model_dump_json(by_alias=True)
    )


def record_of(response: ResponseObject, items: list[Item]) -> StoredResponse:
    return StoredResponse(
        response.id,
        response.created_at,
        response.status,
        response.model_dump_json(by_alias=True),
        _ITEMS.dump_json(items, by_alias=True).decode(),
    )
