"""A streamed response: the chat operation's chunks as OpenAI's Responses events, sent as server-sent
events that each carry `event: <type>` and a `sequence_number` (0, 1, 2, ... in sending order).

Order: response.created, response.in_progress; for the text, output_item.added, content_part.added,
output_text.delta per chunk, output_text.done, content_part.done, output_item.done; for each
function call (sent whole once the generation ends, as the chat stream sends them),
output_item.added, function_call_arguments.delta and .done, output_item.done; last
response.completed (or response.incomplete, cut by max_output_tokens). An error after the first
event is an `error` event, then response.failed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Literal

from pydantic import BaseModel

from gateway.errors import APIError, public_message
from gateway.service.openai_responses_convert import finished, function_call, new_id, text_message
from gateway.service.openai_responses_schemas import Item, ResponseError, ResponseObject, TextContent, output_text
from gateway.service.response_schemas import ChatCompletionChunk, Usage


class ResponseEvent(BaseModel):
    """response.created / in_progress / completed / incomplete / failed: the response as it stands."""

    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(BaseModel):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: Item


class ContentPartEvent(BaseModel):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: TextContent


class TextDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class TextDoneEvent(BaseModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ArgumentsEvent(BaseModel):
    """function_call_arguments.delta carries `delta`, .done carries `arguments`."""

    type: Literal["response.function_call_arguments.delta", "response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str | None = None
    arguments: str | None = None


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    sequence_number: int
    code: str
    message: str
    param: str | None


async def response_events(
    base: ResponseObject,
    chunks: AsyncIterator[ChatCompletionChunk],
    save: Callable[[ResponseObject], Awaitable[None]],
) -> AsyncIterator[BaseModel]:
    """The events of `base`'s stream from the chat chunks (which end with their usage); `save` is
    awaited with the finished response before its last event."""
    seq = iter(range(1 << 62))
    yield ResponseEvent(type="response.created", sequence_number=next(seq), response=base)
    yield ResponseEvent(type="response.in_progress", sequence_number=next(seq), response=base)
    output: list[Item] = []
    text_id: str | None = None
    text, finish, usage = "", None, None
    try:
        async for chunk in chunks:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                if choice.delta.content:
                    if text_id is None:
                        text_id = new_id("msg")
                        for event in _text_opened(seq, text_id, len(output)):
                            yield event
                    text += choice.delta.content
                    yield TextDeltaEvent(
                        sequence_number=next(seq),
                        item_id=text_id,
                        output_index=len(output),
                        content_index=0,
                        delta=choice.delta.content,
                    )
                if choice.delta.tool_calls and text_id is not None:
                    for event in _text_closed(seq, text_id, text, finish, output):
                        yield event
                    text_id = None
                for call in choice.delta.tool_calls or ():
                    for event in _function_call(seq, call.id, call.function.name, call.function.arguments, output):
                        yield event
        if text_id is None and not output:  # an empty answer is still one (empty) message
            text_id = new_id("msg")
            for event in _text_opened(seq, text_id, 0):
                yield event
        if text_id is not None:
            for event in _text_closed(seq, text_id, text, finish, output):
                yield event
    except APIError as exc:
        yield ErrorEvent(
            sequence_number=next(seq),
            code=str(exc.code or exc.type),
            message=public_message(exc.message),
            param=exc.param,
        )
        failed = base.model_copy(
            update={
                "status": "failed",
                "error": ResponseError(code="server_error", message=public_message(exc.message)),
            }
        )
        yield ResponseEvent(type="response.failed", sequence_number=next(seq), response=failed)
        return
    finally:
        await _close(chunks)
    response = finished(base, output, finish, usage or Usage.model_validate(_NO_USAGE))
    await save(response)
    kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
    yield ResponseEvent(type=kind, sequence_number=next(seq), response=response)


async def _close(chunks: AsyncIterator[ChatCompletionChunk]) -> None:
    """Close the chat stream now (a client that left stops its generation), not when collected."""
    close = getattr(chunks, "aclose", None)
    if close is not None:
        await close()


_NO_USAGE = {
    "prompt_tokens": 0,
    "completion_tokens": 0,
    "total_tokens": 0,
    "prompt_tokens_details": {"cached_tokens": 0},
}


def _text_opened(seq: Iterator[int], item_id: str, index: int) -> list[BaseModel]:
    opened = text_message(item_id, "", None).model_copy(update={"content": [], "status": "in_progress"})
    return [
        OutputItemEvent(type="response.output_item.added", sequence_number=next(seq), output_index=index, item=opened),
        ContentPartEvent(
            type="response.content_part.added",
            sequence_number=next(seq),
            item_id=item_id,
            output_index=index,
            content_index=0,
            part=output_text(""),
        ),
    ]


def _text_closed(
    seq: Iterator[int], item_id: str, text: str, finish: str | None, output: list[Item]
) -> list[BaseModel]:
    """The text message's closing events; the message joins `output`."""
    index, item = len(output), text_message(item_id, text, finish)
    output.append(item)
    return [
        TextDoneEvent(sequence_number=next(seq), item_id=item_id, output_index=index, content_index=0, text=text),
        ContentPartEvent(
            type="response.content_part.done",
            sequence_number=next(seq),
            item_id=item_id,
            output_index=index,
            content_index=0,
            part=output_text(text),
        ),
        OutputItemEvent(type="response.output_item.done", sequence_number=next(seq), output_index=index, item=item),
    ]


def _function_call(seq: Iterator[int], call_id: str, name: str, arguments: str, output: list[Item]) -> list[BaseModel]:
    """One whole function call's events; the call joins `output`."""
    index, item_id = len(output), new_id("fc")
    item = function_call(item_id, call_id, name, arguments, "completed")
    output.append(item)
    args = {"sequence_number": 0, "item_id": item_id, "output_index": index}
    return [
        OutputItemEvent(
            type="response.output_item.added",
            sequence_number=next(seq),
            output_index=index,
            item=function_call(item_id, call_id, name, "", "in_progress"),
        ),
        ArgumentsEvent.model_validate(
            {**args, "type": "response.function_call_arguments.delta", "sequence_number": next(seq), "delta": arguments}
        ),
        ArgumentsEvent.model_validate(
            {
                **args,
                "type": "response.function_call_arguments.done",
                "sequence_number": next(seq),
                "arguments": arguments,
            }
        ),
        OutputItemEvent(type="response.output_item.done", sequence_number=next(seq), output_index=index, item=item),
    ]
