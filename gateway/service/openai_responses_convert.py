"""Responses API <-> chat completion: a Responses request and its input context become the chat
completion request the chat operation runs (instructions as the system message, function calls as
an assistant's tool calls, their outputs as tool messages), and the chat answer becomes the
response's output items, status and usage. Plain conversions: nothing here runs a generation."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import ValidationError

from gateway.errors import APIError, bad_request
from gateway.service.openai_responses_schemas import (
    CreateResponseRequest,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    Item,
    ItemStatus,
    MessageItem,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
    TextConfig,
    TextContent,
    output_text,
)
from gateway.service.request_schemas import ChatCompletionRequest
from gateway.service.response_schemas import AssistantMessage, Usage

# The chat request's fields, named as the Responses request names them (for the 400s the chat operation raises).
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(body: CreateResponseRequest) -> list[Item]:
    """This turn's input as stored items: each with an id and a status, text as content parts."""
    items: list[Item] = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    if not items:
        raise bad_request("input must hold at least one item", "input")
    return [_stored(item) for item in items]


def _stored(item: Item) -> Item:
    if isinstance(item, MessageItem):
        is_model = item.role == "assistant"
        text = item.content if isinstance(item.content, str) else None
        content = (
            item.content
            if text is None
            else [output_text(text) if is_model else TextContent(type="input_text", text=text)]
        )
        return item.model_copy(update={"id": item.id or new_id("msg"), "content": content, "status": "completed"})
    prefix = "fc" if isinstance(item, FunctionCallItem) else "fco"
    return item.model_copy(update={"id": item.id or new_id(prefix), "status": item.status or "completed"})


def chat_request(body: CreateResponseRequest, items: list[Item], stream: bool) -> ChatCompletionRequest:
    """The chat completion that answers `body` after the input context `items` (oldest first)."""
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be at least 1, got {body.max_output_tokens}", "max_output_tokens")
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body.instructions, items),
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_completion_tokens": body.max_output_tokens,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
        "separate_reasoning": False,  # no reasoning items here: a model's thinking stays in its text
        "parallel_tool_calls": body.parallel_tool_calls,
        "priority": body.priority,
    }
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type", "strict"}, exclude_none=True)}
            for tool in body.tools
        ]
    if body.tool_choice is not None:
        choice = body.tool_choice
        fields["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    if body.text is not None:
        fields["response_format"] = _response_format(body.text)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise bad_request(f"input cannot be read as a conversation: {exc.errors()[0]['msg']}", "input") from None


def _messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """Chat messages: consecutive function calls join the assistant message before them."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def _response_format(text: TextConfig) -> dict[str, Any] | None:
    """`text.format` as the chat route's `response_format` (whose json_schema nests one level deeper)."""
    spec = text.format
    if spec.type == "text":
        return None
    if spec.type == "json_object":
        return {"type": "json_object"}
    if spec.schema_ is None:
        raise bad_request("text.format json_schema needs a schema", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": spec.name or "output", "schema": spec.schema_}}


def renamed(exc: APIError) -> APIError:
    """A chat operation's error, its param named as the Responses request names it."""
    if exc.param in _PARAMS:
        exc.param = _PARAMS[exc.param]
    return exc


def base_response(body: CreateResponseRequest, response_id: str, status: ResponseStatus) -> ResponseObject:
    """The response object before its output: the request's settings, echoed."""
    return ResponseObject(
        id=response_id,
        created_at=int(time.time()),
        status=status,
        background=body.background,
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=body.model,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id,
        store=body.store,
        temperature=body.temperature,
        top_p=body.top_p,
        text=body.text or TextConfig(),
        tool_choice=body.tool_choice or "auto",
        tools=body.tools or [],
        metadata=body.metadata or {},
        user=body.user,
    )


def finished(base: ResponseObject, output: list[Item], finish_reason: str | None, usage: Usage) -> ResponseObject:
    """`base` with its output and usage; cut by max_output_tokens ("length"): incomplete."""
    is_cut = finish_reason == "length"
    return base.model_copy(
        update={
            "status": "incomplete" if is_cut else "completed",
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if is_cut else None,
            "output": output,
            "usage": response_usage(usage),
        }
    )


def output_items(message: AssistantMessage, finish_reason: str | None) -> list[Item]:
    """The answer as output items: its text as one message (when it has text or no call), then each call."""
    items: list[Item] = []
    if message.content or not message.tool_calls:
        items.append(text_message(new_id("msg"), message.content or "", finish_reason))
    for call in message.tool_calls or ():
        items.append(function_call(new_id("fc"), call.id, call.function.name, call.function.arguments, "completed"))
    return items


def text_message(item_id: str, text: str, finish_reason: str | None) -> MessageItem:
    status: ItemStatus = "incomplete" if finish_reason == "length" else "completed"
    return MessageItem(id=item_id, role="assistant", content=[output_text(text)], status=status)


def function_call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> FunctionCallItem:
    return FunctionCallItem.model_validate(
        {"id": item_id, "call_id": call_id, "name": name, "arguments": arguments, "status": status}
    )


def response_usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )
