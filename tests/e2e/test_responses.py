"""/v1/responses through the real three processes, with the official OpenAI SDK: text and messages,
instructions, previous_response_id chains (kept across a gateway restart), store, retrieve and
delete, streaming, function calls, max_output_tokens, background and cancel, bad input."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.stack import Services, running_services

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--dtype", "bfloat16", "--max-total-tokens", "8192", "--torch-threads", "1", "--transfer-timeout", "7",
         "--kv-write-grace", "7")
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def services(tmp_path_factory) -> Services:
    with running_services(tmp_path_factory.mktemp("responses"), *FLAGS) as services:
        yield services


@pytest.fixture(scope="module")
def client(services: Services) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{services.url}/v1", api_key="None", max_retries=0)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> str:
    answer = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens)
    return answer.choices[0].message.content


def test_text_input_with_instructions_is_the_chat_completion_of_the_same_messages(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Name a color.", instructions="Answer in one word.",
                                       temperature=0, max_output_tokens=16)
    assert response.status == "completed" and response.object == "response"
    expected = chat_text(client, [{"role": "system", "content": "Answer in one word."},
                                  {"role": "user", "content": "Name a color."}], 16)
    assert response.output_text == expected and expected
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 16
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert client.responses.retrieve(response.id).output_text == expected


def test_a_chain_continues_its_first_turn_and_survives_a_gateway_restart(
    client: openai.OpenAI, services: Services
) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0, max_output_tokens=12)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=12)
    conversation = [{"role": "user", "content": "My name is Ada."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    assert second.output_text == chat_text(client, conversation, 12)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items[1].id == first.output[0].id and items[2].content[0].text == "What is my name?"

    services.kill_gateway()
    services.start_gateway("--data-dir", str(services.log_dir / "data"))
    assert client.responses.retrieve(second.id).output_text == second.output_text
    third = client.responses.create(model=MODEL, input="Thanks.", previous_response_id=second.id,
                                    max_output_tokens=4)
    assert len(client.responses.input_items.list(third.id).data) == 5


def test_store_false_keeps_nothing_and_delete_forgets(client: openai.OpenAI) -> None:
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=4)
    assert unstored.store is False and unstored.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="Again", previous_response_id=unstored.id)
    assert missing.value.body["param"] == "previous_response_id"
    stored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(stored.id).id == stored.id
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(stored.id)


def test_a_stream_sends_the_text_of_the_whole_response_in_order(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=64)
    with client.responses.stream(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert whole.status == "completed"
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text
    assert final.usage.input_tokens == whole.usage.input_tokens and final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_a_forced_function_call_and_its_output_turn(client: openai.OpenAI) -> None:
    called = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                     tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64)
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=64) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    [streamed_call] = [item for item in streamed.output if item.type == "function_call"]
    assert (streamed_call.name, json.loads(streamed_call.arguments)) == (call.name, json.loads(call.arguments))
    answered = client.responses.create(
        model=MODEL, previous_response_id=called.id, tools=[WEATHER], max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
    assert answered.status in ("completed", "incomplete") and answered.output_text
    items = client.responses.input_items.list(answered.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]


def test_a_json_schema_text_format_is_followed(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="Pick a color.", max_output_tokens=48,
                                       text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert json.loads(response.output_text)["color"] in ("red", "green", "blue")
    assert client.responses.retrieve(response.id).text.format.type == "json_schema"


def test_max_output_tokens_leaves_the_response_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Write a long story about the sea.", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


def test_background_responses_finish_or_are_cancelled(client: openai.OpenAI, services: Services) -> None:
    quick = client.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=4)
    assert quick.status in ("queued", "in_progress") and quick.background
    long = client.responses.create(model=MODEL, input="Write a very long story about the sea.", background=True,
                                   max_output_tokens=900, temperature=0)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    deadline = time.monotonic() + 60
    while (done := client.responses.retrieve(quick.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert done.status in ("completed", "incomplete") and done.output_text
    assert client.responses.cancel(quick.id).status == done.status  # finished: returned as it is
    services.assert_no_pages_held()


def test_bad_input_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    cases = [({"input": [{"type": "image", "url": "x"}]}, "input.0"),
             ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
             ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
             ({"input": [], "instructions": "x"}, "input"),
             ({"input": "Hi", "background": True, "store": False}, "store"),
             ({"input": "Hi", "background": True, "tool_choice": "required"}, "tool_choice")]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            client.responses.create(model=MODEL, **fields)
        assert bad.value.body["param"] == param, fields
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi")
