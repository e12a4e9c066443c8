"""Anthropic's Messages API (gateway/api/anthropic*.py): the request's conversion to a chat completion,
the answer's and the stream's shapes, and, on the real app with no worker, the error bodies and keys."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.service.anthropic_convert import chat_request, message
from gateway.service.anthropic_schemas import CountTokensRequest, MessagesRequest
from gateway.api.anthropic_stream import events_response, message_events
from gateway.service.request_schemas import ChatRole
from gateway.service.response_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatStreamChoice,
    FunctionCall,
    PromptTokensDetails,
    ToolCallOut,
    Usage,
)

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
BASE = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def test_a_conversation_with_tools_becomes_the_chat_request() -> None:
    body = MessagesRequest.model_validate({
        **BASE, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "stop_sequences": ["\n\n"], "temperature": 0.5, "top_k": 3, "metadata": {"user_id": "u1"},
        "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "Sunny"}]},
                                         {"type": "text", "text": "And tomorrow?"}]},
        ]})
    chat = chat_request(body)
    assert [(m.role, m.content) for m in chat.messages] == [
        (ChatRole.SYSTEM, "Be brief."), (ChatRole.USER, "Weather in Oslo?"), (ChatRole.ASSISTANT, "Checking."),
        (ChatRole.TOOL, "Sunny"), (ChatRole.USER, "And tomorrow?")]
    [call] = chat.messages[2].tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == ("toolu_1", "get_weather",
                                                                                 {"city": "Oslo"})
    assert chat.messages[3].tool_call_id == "toolu_1"
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                            "parameters": WEATHER["input_schema"]}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_k, chat.user) == (8, ["\n\n"], 0.5, 3, "u1")
    assert not chat.stream and chat.separate_reasoning is False


@pytest.mark.parametrize(("choice", "expected"), [("auto", "auto"), ("any", "required"), ("none", "none")])
def test_tool_choice_types_map_onto_the_chat_words(choice: str, expected: str) -> None:
    chat = chat_request(MessagesRequest.model_validate({**BASE, "tools": [WEATHER], "tool_choice": {"type": choice}}))
    assert chat.tool_choice == expected and chat.parallel_tool_calls is None


def test_count_tokens_takes_the_body_without_max_tokens_and_streams_ask_for_usage() -> None:
    body = CountTokensRequest.model_validate({"model": "m", "messages": BASE["messages"]})
    assert chat_request(body).max_tokens is None
    streamed = chat_request(MessagesRequest.model_validate({**BASE, "stream": True}))
    assert streamed.stream and streamed.stream_options.include_usage


def test_misplaced_blocks_and_a_nameless_tool_choice_are_400s() -> None:
    for turn in ({"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                 {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}):
        with pytest.raises(APIError) as refused:
            chat_request(MessagesRequest.model_validate({**BASE, "messages": [turn]}))
        assert refused.value.status == 400 and refused.value.param == "messages"
    with pytest.raises(APIError) as nameless:
        chat_request(MessagesRequest.model_validate({**BASE, "tools": [WEATHER], "tool_choice": {"type": "tool"}}))
    assert nameless.value.param == "tool_choice.name"


def _answer(content: str | None, finish: str, matched: str | int | None = None,
            calls: list[ToolCallOut] | None = None) -> ChatCompletion:
    choice = ChatChoice(index=0, message=AssistantMessage(content=content, reasoning_content=None, tool_calls=calls),
                        logprobs=None, finish_reason=finish, matched_stop=matched)
    return ChatCompletion(id="c", created=0, model="m", choices=[choice],
                          usage=Usage(prompt_tokens=11, completion_tokens=4, total_tokens=15,
                                      prompt_tokens_details=PromptTokensDetails(cached_tokens=0)))


def test_the_answer_is_a_message_with_anthropics_stop_reasons() -> None:
    text = message(_answer("Hello", "stop", 2), "m", "msg_1", ["END"])
    assert text.model_dump() == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": "Hello"}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 11, "output_tokens": 4}}
    stopped = message(_answer("Hel", "stop", "END"), "m", "msg_1", ["END"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "END")
    assert message(_answer("Hello", "length"), "m", "msg_1", None).stop_reason == "max_tokens"
    call = ToolCallOut(id="call_abc", function=FunctionCall(name="get_weather", arguments='{"city": "Oslo"}'))
    tool = message(_answer(None, "tool_calls", calls=[call]), "m", "msg_1", None)
    assert tool.stop_reason == "tool_use"
    assert [b.model_dump() for b in tool.content] == [
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Oslo"}}]
    with pytest.raises(APIError) as aborted:
        message(_answer("x", "abort"), "m", "msg_1", None)
    assert aborted.value.status == 503


def _chunk(delta: ChatDelta | None = None, finish: str | None = None, matched: str | int | None = None,
           output_tokens: int | None = None) -> ChatCompletionChunk:
    choices = [] if delta is None else [ChatStreamChoice(index=0, delta=delta, finish_reason=finish,
                                                         matched_stop=matched)]
    usage = None if output_tokens is None else Usage(prompt_tokens=11, completion_tokens=output_tokens,
                                                     total_tokens=11 + output_tokens,
                                                     prompt_tokens_details=PromptTokensDetails(cached_tokens=0))
    return ChatCompletionChunk(id="c", created=0, model="m", choices=choices, usage=usage)


async def _chunks(*chunks: ChatCompletionChunk):
    for chunk in chunks:
        yield chunk


def _events(*chunks: ChatCompletionChunk, stops: list[str] | None = None) -> list[dict]:
    async def collect() -> list[dict]:
        return [e.model_dump() async for e in message_events(_chunks(*chunks), "m", "msg_1", 11, stops)]
    return asyncio.run(collect())


def test_a_text_stream_has_anthropics_events_in_order() -> None:
    events = _events(_chunk(ChatDelta(role=ChatRole.ASSISTANT, content="")), _chunk(ChatDelta(content="Hel")),
                     _chunk(ChatDelta(content="lo")), _chunk(ChatDelta(), "stop", "END"), _chunk(output_tokens=3),
                     stops=["END"])
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "message_delta",
                                           "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"] == {"input_tokens": 11,
                                                                                        "output_tokens": 0}
    assert events[1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[3] == {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}}
    assert events[6] == {"type": "message_delta", "delta": {"stop_reason": "stop_sequence", "stop_sequence": "END"},
                         "usage": {"input_tokens": 11, "output_tokens": 3}}


def test_a_streamed_tool_call_is_a_tool_use_block_filled_by_one_json_delta() -> None:
    call = ToolCallOut(index=0, id="call_x", function=FunctionCall(name="get_weather", arguments='{"city": "Oslo"}'))
    events = _events(_chunk(ChatDelta(role=ChatRole.ASSISTANT, content="")), _chunk(ChatDelta(tool_calls=[call])),
                     _chunk(ChatDelta(), "tool_calls"), _chunk(output_tokens=9))
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                           "content_block_stop", "message_delta", "message_stop"]
    assert events[1]["content_block"] == {"type": "tool_use", "id": "toolu_x", "name": "get_weather", "input": {}}
    assert json.loads(events[3]["delta"]["partial_json"]) == {"city": "Oslo"}
    assert events[5]["delta"]["stop_reason"] == "tool_use"


def test_events_are_sent_as_named_sse_events_and_a_late_error_as_an_error_event() -> None:
    async def failing():
        yield (await anext(message_events(_chunks(), "m", "msg_1", 1, None)))
        raise APIError(503, "the server is overloaded", "server_overloaded")

    async def body() -> str:
        return "".join([part async for part in events_response(failing()).body_iterator])

    text = asyncio.run(body())
    start, error = text.strip().split("\n\n")
    assert start.startswith("event: message_start\ndata: {")
    assert error.split("\n") == ["event: error", 'data: {"type": "error", "error": {"type": "overloaded_error", '
                                                 '"message": "the server is overloaded"}}']


@pytest.fixture(scope="module")
def keyed_app(smollm2_path: Path, tmp_path_factory):
    config = GatewayConfig(grpc_port=0, model_path=str(smollm2_path), served_model_name="m",
                           prefill_addrs=("127.0.0.1:1",), decode_addrs=("127.0.0.1:1",),
                           data_dir=str(tmp_path_factory.mktemp("data")), api_key="sekret")
    with TestClient(create_app(config)) as client:
        yield client


def _anthropic_error(kind: str, message: str) -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


def test_bad_bodies_are_400s_in_anthropics_shape_naming_the_field(keyed_app: TestClient) -> None:
    key = {"x-api-key": "sekret"}
    cases = (({"model": "m", "messages": BASE["messages"]}, "max_tokens: Field required"),
             ({**BASE, "messages": []}, "messages: List should have at least 1 item"),
             ({**BASE, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role: Input should be"),
             ({**BASE, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
              "messages.0.content.0: Input tag 'image'"),
             ({**BASE, "thinking": {"type": "enabled"}}, "thinking: Extra inputs are not permitted"))
    for body, start in cases:
        refused = keyed_app.post("/v1/messages", json=body, headers=key)
        assert refused.status_code == 400, body
        assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "invalid_request_error"
        assert refused.json()["error"]["message"].startswith(start), refused.json()
    not_json = keyed_app.post("/v1/messages", content=b"{oops", headers=key)
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    other_model = keyed_app.post("/v1/messages", json={**BASE, "model": "other"}, headers=key)
    assert other_model.status_code == 404 and other_model.json()["error"]["type"] == "not_found_error"
    # no worker is up: a good body passes validation and the key, and the gateway says it cannot serve yet
    unready = keyed_app.post("/v1/messages/count_tokens", json=BASE, headers=key)
    assert unready.status_code == 503 and unready.json()["error"]["type"] == "overloaded_error"


def test_the_key_is_taken_from_x_api_key_and_refusals_are_anthropic_shaped(keyed_app: TestClient) -> None:
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        refused = keyed_app.post("/v1/messages", json=BASE, headers=headers)
        assert refused.status_code == 401
        assert refused.json() == _anthropic_error("authentication_error", "Incorrect API key provided.")
    for headers in ({"x-api-key": "sekret"}, {"Authorization": "Bearer sekret"},
                    {"x-api-key": "sekret", "Authorization": "Bearer sekret"}):
        assert keyed_app.post("/v1/messages", json=BASE, headers=headers).status_code == 503, headers
    # x-api-key opens the OpenAI routes too, whose refusals keep OpenAI's shape
    assert keyed_app.get("/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
    assert keyed_app.get("/v1/models", headers={"x-api-key": "wrong"}).json()["error"]["code"] == "invalid_api_key"
    conflicting = keyed_app.post("/v1/messages", json=BASE,
                                 headers={"x-api-key": "sekret", "Authorization": "Bearer other"})
    assert conflicting.status_code == 400 and conflicting.json()["error"]["type"] == "invalid_request_error"
    twice = keyed_app.post("/v1/messages", json=BASE, headers=[("x-api-key", "sekret"), ("x-api-key", "sekret")])
    assert twice.status_code == 400 and "x-api-key" in twice.json()["error"]["message"]


def test_the_sdk_gets_an_authentication_error_for_a_wrong_key(keyed_app: TestClient) -> None:
    wrong = anthropic.Anthropic(base_url=str(keyed_app.base_url), api_key="wrong", http_client=keyed_app,
                                max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 401 and refused.value.body["error"]["type"] == "authentication_error"
    right = anthropic.Anthropic(base_url=str(keyed_app.base_url), api_key="sekret", http_client=keyed_app,
                                max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as unready:  # past the key: no worker is up yet
        right.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}])
    assert unready.value.status_code == 503
