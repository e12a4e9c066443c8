"""Server-sent events for streaming routes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from gateway.errors import APIError


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
