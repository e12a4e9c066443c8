"""A Messages stream: the chat route's chunks as Anthropic's server-sent events.

Events come in Anthropic's order: message_start, then each content block (content_block_start,
its deltas, content_block_stop; a ping after the first block starts), then message_delta with the
stop reason and usage, then message_stop. Text streams as it comes; the chat route holds a choice's
text until it finishes when the request has tools, so tool calls arrive whole, each as one
input_json_delta.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from gateway.api.anthropic_errors import api_error_body, error_body
from gateway.errors import APIError
from gateway.service.anthropic_convert import stop_reason, tool_use_block
from gateway.service.anthropic_schemas import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJSONDelta,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
    MessageUsage,
    Ping,
    StopDelta,
    StreamEvent,
    TextBlock,
    TextDelta,
    ToolUseBlock,
)
from gateway.service.response_schemas import ChatCompletionChunk, ToolCallOut

logger = logging.getLogger(__name__)


class _Blocks:
    """Numbers the content blocks and tells which one is open (a text block stays open across deltas)."""

    def __init__(self) -> None:
        self.num_started = 0
        self.open_index: int | None = None

    def start(self, block: TextBlock | ToolUseBlock) -> list[StreamEvent]:
        events: list[StreamEvent] = [*self.close(), ContentBlockStart(index=self.num_started, content_block=block)]
        if self.num_started == 0:
            events.append(Ping())
        self.open_index = self.num_started
        self.num_started += 1
        return events

    def close(self) -> list[StreamEvent]:
        if self.open_index is None:
            return []
        index, self.open_index = self.open_index, None
        return [ContentBlockStop(index=index)]


async def message_events(
    chunks: AsyncIterator[ChatCompletionChunk],
    model: str,
    message_id: str,
    input_tokens: int,
    stop_sequences: list[str] | None,
) -> AsyncIterator[StreamEvent]:
    """The events of one Messages answer from the chunks of its one-choice chat stream (with usage)."""
    yield MessageStart(
        message=Message(
            id=message_id,
            model=model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=MessageUsage(input_tokens=input_tokens, output_tokens=0),
        )
    )
    blocks = _Blocks()
    finish, matched, output_tokens = None, None, 0
    async for chunk in chunks:
        if chunk.usage is not None:
            output_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                if blocks.open_index is None:
                    for event in blocks.start(TextBlock(text="")):
                        yield event
                yield ContentBlockDelta(index=blocks.num_started - 1, delta=TextDelta(text=choice.delta.content))
            for call in choice.delta.tool_calls or ():
                for event in _tool_use_events(blocks, call):
                    yield event
            if choice.finish_reason is not None:
                finish, matched = choice.finish_reason, choice.matched_stop
    for event in blocks.close():
        yield event
    if blocks.num_started == 0:
        yield Ping()
    reason, sequence = stop_reason(finish, matched, stop_sequences)
    yield MessageDelta(
        delta=StopDelta(stop_reason=reason, stop_sequence=sequence),
        usage=MessageUsage(input_tokens=input_tokens, output_tokens=output_tokens),
    )
    yield MessageStop()


def _tool_use_events(blocks: _Blocks, call: ToolCallOut) -> list[StreamEvent]:
    """A whole tool call: its block starts with an empty input, which one delta then fills."""
    block = tool_use_block(call)
    events = blocks.start(block.model_copy(update={"input": {}}))
    events.append(
        ContentBlockDelta(
            index=blocks.num_started - 1, delta=InputJSONDelta(partial_json=json.dumps(block.input, ensure_ascii=False))
        )
    )
    return events + blocks.close()


def events_response(events: AsyncIterator[StreamEvent]) -> StreamingResponse:
    """`event: <type>` and `data: <json>` per event; an error after the first byte becomes an error event."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield _sse(event.type, event.model_dump())
        except APIError as exc:
            yield _sse("error", api_error_body(exc))
        except Exception:  # the status line is gone: the client can only learn of it from an event
            logger.exception("a Messages stream failed")
            yield _sse("error", error_body(500, "internal server error"))

    return StreamingResponse(body(), media_type="text/event-stream")


def _sse(event_type: str, data: dict) -> str:
    return f"event: {event_type}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
