"""Server-sent events for streaming routes: OpenAI's and SGLang's `data:` lines, the Responses API's typed events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from gateway.errors import APIError
from gateway.service.openai_responses_stream import ArgumentsEvent


def sse_response(events: AsyncIterator[BaseModel]) -> StreamingResponse:
    """`data: {json}` events ending in `data: [DONE]`; an error after the first byte becomes an error event."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event.model_dump(), ensure_ascii=False)}\n\n"
        except APIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def event_stream_response(events: AsyncIterator[BaseModel]) -> StreamingResponse:
    """`event: <type>` / `data: {json}` pairs; no `[DONE]` (the Responses stream ends with its last event)."""

    async def body() -> AsyncIterator[str]:
        async for event in events:
            data = event.model_dump(by_alias=True, exclude_none=isinstance(event, ArgumentsEvent))
            yield f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
