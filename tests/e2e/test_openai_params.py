"""OpenAI parameters through the three processes, with the official SDK, asserting real properties."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from gateway.text.tokenizer import load_tokenizer
from tests.e2e.conftest import MODEL
from tests.e2e.stack import Stack

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "List 3 countries and their capitals."}]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    return load_tokenizer(str(smollm2_path))


def test_seed_000_chat_and_completion_calls_run_as_written(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "You are a helpful AI assistant"},
                               {"role": "user", "content": "List 3 countries and their capitals."}],
        temperature=0, max_tokens=64)
    assert response.choices[0].message.content
    detailed = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "You are a knowledgeable historian who provides concise responses."},
                  {"role": "user", "content": "Tell me about ancient Rome"},
                  {"role": "assistant", "content": "Ancient Rome was a civilization centered in Italy."},
                  {"role": "user", "content": "What were their major achievements?"}],
        temperature=0.3, max_tokens=128, top_p=0.95, presence_penalty=0.2, frequency_penalty=0.2, n=1, seed=42)
    assert detailed.choices[0].message.content and detailed.usage.completion_tokens <= 128
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say this is a test"}],
                                            stream=True, max_tokens=32)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    completion = client.completions.create(model=MODEL, prompt="List 3 countries and their capitals.",
                                           temperature=0, max_tokens=64, n=1, stop=None)
    assert completion.choices[0].text
    story = client.completions.create(model=MODEL, prompt="Write a short story about a space explorer.",
                                      temperature=0.7, max_tokens=150, top_p=0.9, stop=["\n\n", "THE END"],
                                      presence_penalty=0.3, frequency_penalty=0.3, n=1, seed=123)
    assert "\n\n" not in story.choices[0].text and "THE END" not in story.choices[0].text


def test_max_tokens_is_exact_and_usage_matches_the_tokenizer(client: openai.OpenAI, tokenizer) -> None:
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=7,
                                              extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 7 and response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(tokenizer.apply_chat_template(QUESTION))
    assert response.usage.total_tokens == response.usage.prompt_tokens + 7


def test_n_choices_are_distinct_and_a_seed_reproduces_them(client: openai.OpenAI) -> None:
    def ask():
        return client.chat.completions.create(model=MODEL, messages=QUESTION, n=3, temperature=1.0, seed=7,
                                              max_tokens=12)
    first, again = ask(), ask()
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) > 1
    assert texts == [c.message.content for c in again.choices]
    single = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=1.0, seed=7, max_tokens=12)
    assert single.choices[0].message.content == texts[0]


def test_chat_logprobs_have_the_right_shape_and_values(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)


def test_completion_logprobs_echo_best_of_and_prompt_lists(client: openai.OpenAI, tokenizer) -> None:
    response = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                         temperature=0, logprobs=2)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == response.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, echo=True,
                                       temperature=0)
    assert echoed.choices[0].text == "The capital of France is" + response.choices[0].text
    # echo + logprobs: the prompt's own tokens lead, the first without a logprob (as in OpenAI / vLLM)
    both = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, echo=True,
                                     temperature=0, logprobs=2)
    prompt_ids = tokenizer.encode("The capital of France is")
    elp = both.choices[0].logprobs
    assert len(elp.tokens) == len(prompt_ids) + 5 and "".join(elp.tokens) == both.choices[0].text
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(lp <= 0 for lp in elp.token_logprobs[1:])
    assert elp.token_logprobs[len(prompt_ids):] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert elp.text_offset == sorted(elp.text_offset) and elp.text_offset[len(prompt_ids)] == len(
        "The capital of France is")
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, echo=True,
                                         temperature=0, logprobs=2, stream=True)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert chunks[0].text == "The capital of France is"
    assert chunks[0].logprobs.token_logprobs == pytest.approx(elp.token_logprobs[:len(prompt_ids)], abs=1e-4)
    assert "".join(c.text for c in chunks) == both.choices[0].text
    best = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, best_of=3, n=1,
                                     temperature=1.0, seed=3)
    assert len(best.choices) == 1 and 3 <= best.usage.completion_tokens <= 24   # all three candidates count
    many = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=4, temperature=0)
    assert len(many.choices) == 2 and many.usage.prompt_tokens == len(tokenizer.encode("Hello")) + \
        len(tokenizer.encode("Goodbye"))
    ids = client.completions.create(model=MODEL, prompt=tokenizer.encode("The capital of France is"), max_tokens=5,
                                    temperature=0)
    assert ids.choices[0].text == response.choices[0].text


def test_no_stop_trim_extra_keeps_the_stop_string(client: openai.OpenAI) -> None:
    trimmed = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0,
                                        stop=[" 5"])
    kept = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0,
                                     stop=[" 5"], extra_body={"no_stop_trim": True})
    assert trimmed.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    assert kept.choices[0].text == trimmed.choices[0].text + " 5"


def test_logit_bias_and_min_tokens(client: openai.OpenAI, tokenizer) -> None:
    [token] = tokenizer.encode(" Paris")
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={str(token): 100})
    assert forced.choices[0].text == " Paris" * 4
    short = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                           max_tokens=40, temperature=0)
    longer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                            max_tokens=short.usage.completion_tokens + 20, temperature=0,
                                            extra_body={"min_tokens": short.usage.completion_tokens + 5})
    assert longer.usage.completion_tokens >= short.usage.completion_tokens + 5


def test_unsupported_and_invalid_parameters_are_clear_400s(stack: Stack) -> None:
    cases = [({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": "x", "logprobs": 21}, "logprobs"),
             ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"), ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
             ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias")]
    for extra, param in cases:
        response = httpx.post(f"{stack.url}/v1/completions", json={"model": MODEL, "max_tokens": 2, **extra})
        assert response.status_code == 400, extra
        assert response.json()["error"]["param"] == param
    chat = httpx.post(f"{stack.url}/v1/chat/completions",
                      json={"model": MODEL, "messages": QUESTION, "top_logprobs": 2})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "top_logprobs"


def test_native_generate_returns_logprobs_in_sglangs_shape(stack: Stack) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 4},
            "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    meta = httpx.post(f"{stack.url}/generate", json=body, timeout=60).json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == 4 and len(meta["output_top_logprobs"]) == 4
    logprob, token_id, text = meta["output_token_logprobs"][0]
    assert meta["output_top_logprobs"][0][0][1] == token_id and text == " Paris"


def test_vllm_utility_routes(stack: Stack, tokenizer) -> None:
    tokens = httpx.post(f"{stack.url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert tokens["tokens"] == tokenizer.encode("Hello world") and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 1024
    chat = httpx.post(f"{stack.url}/tokenize", json={"messages": QUESTION}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(QUESTION)
    text = httpx.post(f"{stack.url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    assert httpx.post(f"{stack.url}/detokenize", json={"tokens": [10**7]}).status_code == 400
    assert httpx.get(f"{stack.url}/version").json()["version"]
    assert httpx.get(f"{stack.url}/ping").status_code == 200


def test_cached_tokens_report_the_prefill_servers_prefix_cache_hits(client: openai.OpenAI, stack: Stack) -> None:
    system = {"role": "system", "content": "You are a careful assistant. " + "Answer briefly and exactly. " * 30}
    def ask(question: str):
        return client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": question}],
                                              max_tokens=2, temperature=0)
    cold = ask("What is 2 + 2?")
    warm = ask("What is 3 + 3?")
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert 150 < cached <= warm.usage.prompt_tokens
    assert cached % 16 == 0   # whole pages
    meta = httpx.post(f"{stack.url}/generate", json={"text": "Answer briefly and exactly. " * 30 + "Hi",
                                                     "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    again = httpx.post(f"{stack.url}/generate", json={"text": "Answer briefly and exactly. " * 30 + "Yo",
                                                      "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    assert meta["cached_tokens"] < again["cached_tokens"] <= again["prompt_tokens"]


CITY_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                "population": {"type": "integer"}},
               "required": ["name", "population"], "additionalProperties": False}


def test_response_format_json_schema_and_json_object_are_enforced(client: openai.OpenAI) -> None:
    strict = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a city as JSON."}], max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA,
                                                                "strict": True}})
    value = json.loads(strict.choices[0].message.content)
    assert set(value) == {"name", "population"} and isinstance(value["population"], int)
    anything = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat."}], max_tokens=80,
        response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_regex_and_ebnf_extras_and_generate_json_schema(client: openai.OpenAI, stack: Stack) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is fire cold?"}],
                                            max_tokens=5, extra_body={"regex": "(yes|no)"})
    assert answer.choices[0].message.content in ("yes", "no")
    grammar = 'root ::= "The answer is " ("red" | "blue")'
    colour = client.completions.create(model=MODEL, prompt="Pick a colour:", max_tokens=20,
                                       extra_body={"ebnf": grammar})
    assert colour.choices[0].text in ("The answer is red", "The answer is blue")
    flag_schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                    "is_capital": {"type": "boolean"}},
                   "required": ["name", "is_capital"], "additionalProperties": False}
    native = httpx.post(f"{stack.url}/generate", json={"text": "A city as JSON:", "sampling_params": {
        "max_new_tokens": 100, "json_schema": json.dumps(flag_schema)}}, timeout=120).json()
    value = json.loads(native["text"])
    assert set(value) == {"name", "is_capital"} and isinstance(value["is_capital"], bool)


def test_bad_constraints_are_400s(stack: Stack) -> None:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for extra, param in (({"response_format": {"type": "json_schema"}}, "response_format"),
                         ({"response_format": {"type": "xml"}}, "response_format"),
                         ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf")):
        response = httpx.post(f"{stack.url}/v1/chat/completions", json={**base, **extra})
        assert response.status_code == 400, extra
        assert response.json()["error"]["param"] == param
    broken = httpx.post(f"{stack.url}/v1/chat/completions", json={**base, "regex": "(a|"})
    assert broken.status_code == 400 and "invalid regex" in broken.json()["error"]["message"]


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string", "maxLength": 30}},
                                                     "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Current time",
                                              "parameters": {"type": "object", "properties": {},
                                                             "additionalProperties": False}}}


def test_named_and_required_tool_choice_return_parsed_tool_calls(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    required = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER_TOOL, TIME_TOOL],
                                              tool_choice="required", max_tokens=80)
    assert required.choices[0].message.tool_calls
    assert {c.function.name for c in required.choices[0].message.tool_calls} <= {"get_weather", "get_time"}
    none = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER_TOOL], tool_choice="none",
                                          max_tokens=20)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_streamed_tool_calls_and_a_tool_result_round_trip(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    stream = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER_TOOL], stream=True,
                                            max_tokens=60,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls, finish = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            calls += chunk.choices[0].delta.tool_calls
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "tool_calls" and calls[0].function.name == "get_weather"
    follow_up = client.chat.completions.create(model=MODEL, max_tokens=30, tools=[WEATHER_TOOL], messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].id, "type": "function", "function": {
            "name": "get_weather", "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 21 C"}])
    bare = client.chat.completions.create(model=MODEL, max_tokens=1, tools=[WEATHER_TOOL], messages=ask)
    # the earlier call and the tool's answer are rendered into the prompt, not dropped
    assert follow_up.usage.prompt_tokens > bare.usage.prompt_tokens + len("Sunny, 21 C") // 4
    assert follow_up.choices[0].message.content or follow_up.choices[0].message.tool_calls


def test_reasoning_is_separated_and_a_final_message_can_be_continued(client: openai.OpenAI) -> None:
    thinking = 'root ::= "<think>" "France, capital" "</think>" "\\n\\n" "Paris."'
    ask = [{"role": "user", "content": "Capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=30, extra_body={"ebnf": thinking})
    message = whole.choices[0].message
    assert message.content == "Paris." and message.model_extra["reasoning_content"] == "France, capital"
    kept = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=30,
                                          extra_body={"ebnf": thinking, "separate_reasoning": False})
    assert kept.choices[0].message.content.startswith("<think>")
    stream = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=30, stream=True,
                                            extra_body={"ebnf": thinking})
    reasoning = content = ""
    for chunk in stream:
        if chunk.choices:
            reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == ("France, capital", "Paris.")
    continued = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[*ask, {"role": "assistant", "content": "The capital of France is"}],
        extra_body={"continue_final_message": True})
    assert "Paris" in continued.choices[0].message.content


def test_malformed_requests_are_400s_never_500s(stack: Stack) -> None:
    ok = [{"role": "user", "content": "hi"}]
    cases = [({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
             ({"model": MODEL, "messages": []}, "messages"),
             ({"model": MODEL, "messages": ok, "temperature": "hot"}, "temperature"),
             ({"model": MODEL, "messages": "hi"}, "messages"),
             ({"model": MODEL, "messages": ok, "n": 0}, "n"),
             ({"model": MODEL, "messages": ok, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             ({"messages": ok}, "model")]
    for body, param in cases:
        response = httpx.post(f"{stack.url}/v1/chat/completions", json=body)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
    not_json = httpx.post(f"{stack.url}/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "error" in not_json.json()
