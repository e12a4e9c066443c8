"""Anthropic's Messages API through the three processes, driven by the official `anthropic` SDK."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import pytest

from gateway.text.tokenizer import load_tokenizer
from tests.e2e.conftest import MODEL
from tests.e2e.stack import Stack
from tests.e2e.test_openai_params import WEATHER_TOOL

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful AI assistant."
# This SDK's `create` has no sampling arguments; the API's body still takes them.
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "List 3 countries and their capitals."}]
# the OpenAI test's tool, so that the forced call's grammar is the one that test already compiled
WEATHER = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
           "input_schema": WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def claude(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key="None", max_retries=0)


@pytest.fixture(scope="module")
def greedy(claude: anthropic.Anthropic) -> anthropic.types.Message:
    return claude.messages.create(model=MODEL, max_tokens=24, system=SYSTEM, messages=ASK, extra_body=GREEDY)


def test_a_message_with_a_system_prompt_and_its_token_count(claude: anthropic.Anthropic, greedy,
                                                            smollm2_path: Path) -> None:
    assert greedy.id.startswith("msg_") and greedy.type == "message" and greedy.role == "assistant"
    assert greedy.model == MODEL and greedy.content[0].type == "text" and greedy.content[0].text
    assert greedy.stop_reason in ("end_turn", "max_tokens") and greedy.stop_sequence is None
    prompt = [{"role": "system", "content": SYSTEM}, *ASK]
    assert greedy.usage.input_tokens == len(load_tokenizer(str(smollm2_path)).apply_chat_template(prompt))
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == greedy.usage.input_tokens
    short = claude.messages.create(model=MODEL, max_tokens=3, system=SYSTEM, messages=ASK, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    assert greedy.content[0].text.startswith(short.content[0].text)


def test_a_stop_sequence_ends_the_text_before_it(claude: anthropic.Anthropic, greedy) -> None:
    text = greedy.content[0].text
    stop = text.split()[2]  # a word the greedy answer reaches
    stopped = claude.messages.create(model=MODEL, max_tokens=24, system=SYSTEM, messages=ASK, extra_body=GREEDY,
                                     stop_sequences=[stop, "never in the text"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[:text.index(stop)]


def test_streamed_text_deltas_join_to_the_greedy_text(stack: Stack, claude: anthropic.Anthropic, greedy) -> None:
    with claude.messages.stream(model=MODEL, max_tokens=24, system=SYSTEM, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == greedy.content[0].text
    assert final.stop_reason == greedy.stop_reason and final.usage == greedy.usage
    # the raw events (the SDK drops pings): each `event:` line names its data's type
    raw = httpx.post(f"{stack.url}/v1/messages", json={"model": MODEL, "max_tokens": 4, "system": SYSTEM,
                                                       "messages": ASK, "stream": True, **GREEDY})
    assert raw.headers["content-type"].startswith("text/event-stream")
    pairs = [event.split("\n") for event in raw.text.strip().split("\n\n")]
    events = [name.removeprefix("event: ") for name, _ in pairs]
    assert [json.loads(data.removeprefix("data: "))["type"] for _, data in pairs] == events
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) == {"content_block_delta"}


def test_a_named_tool_choice_gives_a_tool_use_and_its_result_is_taken(claude: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = claude.messages.create(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"})
    assert forced.stop_reason == "tool_use"
    [call] = [block for block in forced.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    assert set(call.input) == {"city"} and isinstance(call.input["city"], str) and len(call.input["city"]) <= 30
    with claude.messages.stream(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and set(streamed.content[-1].input) == {"city"}
    follow_up = [*ask, {"role": "assistant", "content": forced.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]}]
    answered = claude.messages.create(model=MODEL, max_tokens=20, messages=follow_up, tools=[WEATHER])
    assert answered.content and answered.stop_reason in ("end_turn", "max_tokens", "tool_use")
    bare = claude.messages.count_tokens(model=MODEL, messages=ask, tools=[WEATHER])
    # the call and the tool's answer are rendered into the prompt, not dropped
    assert answered.usage.input_tokens > bare.input_tokens + len("Sunny, 21 C") // 4
    assert claude.messages.count_tokens(model=MODEL, messages=follow_up, tools=[WEATHER]).input_tokens == \
        answered.usage.input_tokens


def test_bad_bodies_are_400s_in_anthropics_shape(stack: Stack, claude: anthropic.Anthropic) -> None:
    base = {"model": MODEL, "max_tokens": 4, "messages": ASK}
    for body, field in (({"model": MODEL, "messages": ASK}, "max_tokens"), ({**base, "messages": []}, "messages"),
                        ({**base, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role")):
        refused = httpx.post(f"{stack.url}/v1/messages", json=body)
        assert refused.status_code == 400, body
        assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "invalid_request_error"
        assert refused.json()["error"]["message"].startswith(field + ":")
    with pytest.raises(anthropic.BadRequestError) as refused_by_sdk:
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "system", "content": "hi"}])
    assert refused_by_sdk.value.status_code == 400 and refused_by_sdk.value.body["error"]["type"] == \
        "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
