"""openai_responses_stream: chat chunks as Responses events, in order and numbered, and their SSE form."""

from __future__ import annotations

import asyncio
import json

from gateway.errors import APIError
from gateway.service.openai_responses_convert import base_response
from gateway.service.openai_responses_schemas import CreateResponseRequest, ResponseObject
from gateway.api.sse import event_stream_response
from gateway.service.openai_responses_stream import response_events
from gateway.service.response_schemas import ChatCompletionChunk

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}}
BASE = base_response(CreateResponseRequest(model="smol", input="Hi"), "resp_1", "in_progress")


def _chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> ChatCompletionChunk:
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return ChatCompletionChunk.model_validate(
        {"id": "c", "created": 0, "model": "smol", "choices": choices, "usage": usage}
    )


async def _chunks(*chunks: ChatCompletionChunk, error: APIError | None = None):
    for chunk in chunks:
        yield chunk
    if error is not None:
        raise error


def _events(chunks, saved: list[ResponseObject]) -> list[dict]:
    async def save(response: ResponseObject) -> None:
        saved.append(response)

    async def collect() -> list[dict]:
        return [e.model_dump(by_alias=True) async for e in response_events(BASE, chunks, save)]

    return asyncio.run(collect())


def test_text_events_in_order_numbered_and_saved() -> None:
    saved: list[ResponseObject] = []
    events = _events(
        _chunks(
            _chunk({"role": "assistant", "content": ""}),
            _chunk({"content": "Hel"}),
            _chunk({"content": "lo"}),
            _chunk({}, "stop"),
            _chunk({}, usage=USAGE),
        ),
        saved,
    )
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[2]["item"]["status"] == "in_progress" and events[2]["item"]["content"] == []
    assert {e["item_id"] for e in events[3:8]} == {events[2]["item"]["id"]}
    assert events[8]["item"]["id"] == events[2]["item"]["id"]
    assert events[6]["text"] == "Hello" and events[8]["item"]["content"][0]["text"] == "Hello"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 2
    assert [r.id for r in saved] == ["resp_1"] and saved[0].output[0].text() == "Hello"


def test_function_calls_and_a_cut_answer() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    events = _events(
        _chunks(
            _chunk({"role": "assistant", "content": ""}),
            _chunk({"tool_calls": [call]}),
            _chunk({}, "length"),
            _chunk({}, usage=USAGE),
        ),
        [],
    )
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[2]["item"]["arguments"] == "" and events[3]["delta"] == '{"a": 1}'
    assert events[4]["arguments"] == '{"a": 1}' and events[5]["item"]["call_id"] == "call_1"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_error_mid_stream_is_an_error_event_then_failed() -> None:
    saved: list[ResponseObject] = []
    error = APIError(503, "decode worker at 10.0.0.7:31002 went away", "service_unavailable")
    events = _events(_chunks(_chunk({"content": "Hi"}), error=error), saved)
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert "10.0.0.7" not in json.dumps(events) and saved == []
    assert events[-1]["response"]["error"]["code"] == "server_error"


def test_each_event_is_sent_with_its_type() -> None:
    async def body() -> str:
        response = event_stream_response(response_events(BASE, _chunks(_chunk({}, "stop")), _no_save))
        return "".join([part async for part in response.body_iterator])

    text = asyncio.run(body())
    blocks = [b for b in text.split("\n\n") if b]
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line == f"event: {json.loads(data_line.removeprefix('data: '))['type']}"
    assert "[DONE]" not in text and blocks[-1].startswith("event: response.completed")


async def _no_save(response: ResponseObject) -> None:
    return None


def test_closing_the_events_closes_the_chat_stream_at_once() -> None:
    """A client that leaves mid-stream: its chat stream (and so its generation) is closed then, not
    when collected."""
    closed: list[bool] = []

    async def chunks():
        try:
            yield _chunk({"content": "a"})
            yield _chunk({"content": "b"})
        finally:
            closed.append(True)

    async def main() -> None:
        events = response_events(BASE, chunks(), _no_save)
        async for event in events:
            if event.type == "response.output_text.delta":
                break
        assert closed == []
        await events.aclose()

    asyncio.run(main())
    assert closed == [True]
