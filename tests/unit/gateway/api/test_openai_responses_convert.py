"""openai_responses_convert: a Responses request and its context as the chat request; the chat answer
as output items, status and usage."""

from __future__ import annotations

import pytest

from gateway.errors import APIError, bad_request
from gateway.service.openai_responses_convert import (
    base_response,
    chat_request,
    finished,
    input_items,
    output_items,
    renamed,
)
from gateway.service.openai_responses_schemas import CreateResponseRequest, FunctionCallItem, MessageItem
from gateway.service.response_schemas import AssistantMessage, FunctionCall, ToolCallOut, Usage

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}
USAGE = Usage.model_validate(
    {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 2}}
)


def _request(**fields) -> CreateResponseRequest:
    return CreateResponseRequest.model_validate({"model": "smol", **fields})


def test_text_input_is_one_user_message_with_an_id() -> None:
    [item] = input_items(_request(input="Hi"))
    assert isinstance(item, MessageItem) and item.role == "user" and item.status == "completed"
    assert item.id.startswith("msg_") and item.model_dump(exclude_none=True)["content"] == [
        {"type": "input_text", "text": "Hi"}
    ]


def test_items_keep_their_ids_and_assistant_text_is_output_text() -> None:
    body = _request(
        input=[
            {"id": "msg_1", "role": "assistant", "content": "Hello"},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        ]
    )
    message, call, output = input_items(body)
    assert message.id == "msg_1" and message.content[0].type == "output_text"
    assert call.id.startswith("fc_") and output.id.startswith("fco_")


def test_empty_input_is_a_400() -> None:
    with pytest.raises(APIError) as bad:
        input_items(_request(input=[]))
    assert bad.value.param == "input"


def test_the_chat_request_carries_instructions_calls_outputs_and_settings() -> None:
    body = _request(
        input="unused",
        instructions="Be brief.",
        temperature=0.5,
        top_p=0.9,
        max_output_tokens=8,
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
    )
    items = input_items(
        _request(
            input=[
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"role": "assistant", "content": "Let me look."},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"a": 1}'},
                {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ]
        )
    )
    chat = chat_request(body, items, stream=True)
    roles = [(m.role.value, m.text(), [c.id for c in m.tool_calls or ()]) for m in chat.messages]
    assert roles == [
        ("system", "Be brief.", []),
        ("user", "Weather?", []),
        ("assistant", "Let me look.", ["c1", "c2"]),
        ("tool", "sunny", []),
    ]
    assert chat.messages[3].tool_call_id == "c1"
    assert (chat.temperature, chat.top_p, chat.max_completion_tokens) == (0.5, 0.9, 8)
    assert chat.stream and chat.stream_options.include_usage and not chat.separate_reasoning
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}


def test_text_formats() -> None:
    items = input_items(_request(input="Hi"))
    plain = chat_request(_request(input="Hi", text={"format": {"type": "text"}}), items, stream=False)
    assert plain.response_format is None and not plain.stream
    json_object = chat_request(_request(input="Hi", text={"format": {"type": "json_object"}}), items, stream=False)
    assert json_object.response_format == {"type": "json_object"}
    with pytest.raises(APIError) as bad:
        chat_request(_request(input="Hi", text={"format": {"type": "json_schema", "name": "x"}}), items, stream=False)
    assert bad.value.param == "text.format.schema"


def test_max_output_tokens_below_one_is_a_400() -> None:
    with pytest.raises(APIError) as bad:
        chat_request(_request(input="Hi", max_output_tokens=0), input_items(_request(input="Hi")), stream=False)
    assert bad.value.param == "max_output_tokens"


def test_the_chat_operations_params_are_renamed() -> None:
    assert renamed(bad_request("too many", "max_completion_tokens")).param == "max_output_tokens"
    assert renamed(bad_request("bad", "response_format")).param == "text.format"
    assert renamed(bad_request("bad", "tool_choice")).param == "tool_choice"


def test_output_items_text_then_calls() -> None:
    call = ToolCallOut(id="call_9", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
    message = AssistantMessage(content="Checking.", reasoning_content=None, tool_calls=[call])
    text, function_call = output_items(message, "tool_calls")
    assert isinstance(text, MessageItem) and text.text() == "Checking." and text.status == "completed"
    assert isinstance(function_call, FunctionCallItem)
    assert (function_call.call_id, function_call.name, function_call.arguments) == (
        "call_9",
        "get_weather",
        '{"city": "Paris"}',
    )
    [only_call] = output_items(AssistantMessage(content="", reasoning_content=None, tool_calls=[call]), "tool_calls")
    assert only_call.type == "function_call"
    [empty] = output_items(AssistantMessage(content=None, reasoning_content=None, tool_calls=None), "stop")
    assert empty.type == "message" and empty.text() == ""


def test_a_length_finish_is_incomplete_with_its_reason() -> None:
    base = base_response(_request(input="Hi", max_output_tokens=3, store=False), "resp_1", "in_progress")
    assert (base.store, base.tool_choice, base.tools, base.metadata, base.parallel_tool_calls) == (
        False,
        "auto",
        [],
        {},
        True,
    )
    message = AssistantMessage(content="Once", reasoning_content=None, tool_calls=None)
    cut = finished(base, output_items(message, "length"), "length", USAGE)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"
    usage = cut.usage.model_dump()
    assert usage == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 10,
    }
    done = finished(base, output_items(message, "stop"), "stop", USAGE)
    assert done.status == "completed" and done.incomplete_details is None
