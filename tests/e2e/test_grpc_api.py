"""The gRPC API (tandem.api.v1) against the HTTP API on the same three-process stack: a client from the
repo's generated stubs sends each request both ways and gets the same answer (greedy, fp32), field by
field where the proto spells OpenAI's and SGLang's JSON its own way."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tandem.api.v1 import completion_pb2, generate_pb2, inference_service_pb2
from tests.e2e.grpc_client import MODEL, chat_request, inference_api
from tests.e2e.stack import Stack
from tests.e2e.test_openai_params import CITY_SCHEMA, TIME_TOOL, WEATHER_TOOL

pytestmark = pytest.mark.slow

QUESTION = "List 3 countries and their capitals."
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def api(stack: Stack):
    with inference_api(stack.grpc_target) as api:
        yield api


def _http_generate(stack: Stack, **body) -> dict | list:
    reply = httpx.post(f"{stack.url}/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_chat_unary_and_streamed_equal_the_http_route(api, client: openai.OpenAI) -> None:
    http = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=24)
    unary = api.ChatComplete(chat_request(QUESTION, temperature=0, max_tokens=24), timeout=60)
    (choice,) = unary.choices
    assert (choice.message.role, choice.message.content) == ("assistant", http.choices[0].message.content)
    assert choice.finish_reason == http.choices[0].finish_reason == "length"
    assert not choice.message.HasField("reasoning_content") and not choice.message.tool_calls
    assert (unary.object, unary.model) == ("chat.completion", MODEL) and unary.id.startswith("chatcmpl-")
    assert (unary.usage.prompt_tokens, unary.usage.completion_tokens) == (http.usage.prompt_tokens, 24)

    request = chat_request(QUESTION, temperature=0, max_tokens=24, request_id="grpc-chat-stream")
    request.stream_options.include_usage = True
    chunks = list(api.ChatCompleteStream(request, timeout=60))
    assert {c.id for c in chunks} == {"grpc-chat-stream"} and {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == http.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert not chunks[-1].choices and chunks[-1].usage.total_tokens == http.usage.total_tokens


def test_completions_with_echo_logprobs_and_stop_strings_equal_the_http_route(api, client: openai.OpenAI) -> None:
    http = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, echo=True, logprobs=2, temperature=0)
    request = completion_pb2.CompletionRequest(model=MODEL, prompt=[PROMPT], max_tokens=5, echo=True, logprobs=2,
                                               temperature=0)
    (choice,) = api.Complete(request, timeout=60).choices
    assert choice.text == http.choices[0].text and choice.text.startswith(PROMPT)
    logprobs, expected = choice.logprobs, http.choices[0].logprobs
    assert list(logprobs.tokens) == expected.tokens and list(logprobs.text_offset) == expected.text_offset
    # The prompt's first token has no logprob (null in JSON, an unset NullableDouble here).
    assert not logprobs.token_logprobs[0].HasField("value") and expected.token_logprobs[0] is None
    assert [e.value for e in logprobs.token_logprobs[1:]] == pytest.approx(expected.token_logprobs[1:], abs=1e-4)
    assert [dict(e.logprobs) for e in logprobs.top_logprobs[1:]] == [
        pytest.approx(top, abs=1e-4) for top in expected.top_logprobs[1:]]

    stopped_http = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stop=["."], temperature=0)
    stopped = completion_pb2.CompletionRequest(model=MODEL, prompt=[PROMPT], max_tokens=12, stop=["."], temperature=0)
    (choice,) = api.Complete(stopped, timeout=60).choices
    assert (choice.text, choice.finish_reason) == (stopped_http.choices[0].text, "stop") and "." not in choice.text
    assert choice.WhichOneof("matched_stop") == "matched_stop_text" and choice.matched_stop_text == "."
    streamed = list(api.CompleteStream(stopped, timeout=60))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert [c.choices[0].matched_stop_text for c in streamed if c.choices and c.choices[0].finish_reason] == ["."]


def test_generate_with_input_ids_and_prompt_logprobs_equals_the_http_route(api, stack: Stack) -> None:
    ids = list(api.Tokenize(inference_service_pb2.TokenizeRequest(model=MODEL, prompt=PROMPT), timeout=30).tokens)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    http = _http_generate(stack, **body)
    request = generate_pb2.GenerateRequest(
        sampling_params=generate_pb2.SamplingParams(max_new_tokens=4, temperature=0), return_logprob=True,
        logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True, rid="grpc-generate")
    request.input_ids.add(ids=ids)
    (output,) = api.Generate(request, timeout=60).outputs
    meta = output.meta_info
    assert (output.text, list(output.output_ids)) == (http["text"], http["output_ids"])
    assert (meta.id, meta.prompt_tokens, meta.completion_tokens) == ("grpc-generate", len(ids), 4)
    assert (meta.finish_reason.type, meta.finish_reason.length) == ("length", 4)
    assert meta.tandem_timings.first_token_ms >= meta.tandem_timings.prefill_compute_ms > 0
    assert meta.tandem_timings.kv_bytes > 0 and meta.e2e_latency * 1000 >= meta.tandem_timings.first_token_ms
    # SGLang's [logprob, id, text] triples, the prompt's first without a logprob.
    prompt = [(e.logprob if e.HasField("logprob") else None, e.token_id, e.token_text) for e in meta.input_token_logprobs]
    expected = http["meta_info"]["input_token_logprobs"]
    assert [(i, t) for _, i, t in prompt] == [(i, t) for _, i, t in expected] and prompt[0][0] is None
    assert [p for p, _, _ in prompt[1:]] == pytest.approx([p for p, _, _ in expected[1:]], abs=1e-4)
    assert [e.token_id for e in meta.output_token_logprobs] == http["output_ids"]
    assert not meta.input_top_logprobs[0].entries and len(meta.input_top_logprobs[1].entries) == 2

    request.ClearField("rid")
    streamed = list(api.GenerateStream(request, timeout=60))
    with httpx.stream("POST", f"{stack.url}/generate", json={**body, "stream": True}, timeout=60) as reply:
        events = [json.loads(line[5:]) for line in reply.iter_lines()
                  if line.startswith("data:") and line != "data: [DONE]"]
    # Each message carries the text and ids so far, as each of SGLang's events does.
    assert [(o.text, list(o.output_ids)) for o in streamed] == [(e["text"], e["output_ids"]) for e in events]
    assert streamed[-1].text == http["text"] and list(streamed[-1].output_ids) == http["output_ids"]
    assert [o.meta_info.finish_reason.type for o in streamed] == [""] * (len(streamed) - 1) + ["length"]


def test_n_choices_and_several_prompts_come_back_in_order(api, stack: Stack) -> None:
    params = {"max_new_tokens": 5, "temperature": 0.9, "n": 2, "sampling_seed": 7}
    http = _http_generate(stack, text=["Once upon a time", "Hello"], sampling_params=params)
    request = generate_pb2.GenerateRequest(text=["Once upon a time", "Hello"],
                                           sampling_params=generate_pb2.SamplingParams(**params))
    outputs = api.Generate(request, timeout=60).outputs
    assert [o.index for o in outputs] == [0, 1, 2, 3] and [o.text for o in outputs] == [h["text"] for h in http]

    chat = api.ChatComplete(chat_request("Name a colour.", n=3, temperature=1.0, seed=3, max_tokens=6), timeout=60)
    http_chat = httpx.post(f"{stack.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "n": 3, "temperature": 1.0,
        "seed": 3, "max_tokens": 6}).json()
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert [c.message.content for c in chat.choices] == [c["message"]["content"] for c in http_chat["choices"]]
    assert chat.usage.completion_tokens == http_chat["usage"]["completion_tokens"]


def test_a_named_tool_choice_and_a_json_schema_response_format(api) -> None:
    request = chat_request("What is the weather in Paris?", max_tokens=60)
    for tool in (WEATHER_TOOL, TIME_TOOL):
        added = request.tools.add(type="function")
        added.function.name, added.function.description = tool["function"]["name"], tool["function"]["description"]
        added.function.parameters.update(tool["function"]["parameters"])
    request.tool_choice.function.name = "get_weather"
    (choice,) = api.ChatComplete(request, timeout=60).choices
    assert choice.finish_reason == "tool_calls" and not choice.message.HasField("content")
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather") and call.id
    assert set(json.loads(call.function.arguments)) == {"city"}
    streamed = [c for c in api.ChatCompleteStream(request, timeout=60) if c.choices]
    calls = [call for c in streamed for call in c.choices[0].delta.tool_calls]
    assert [call.function.name for call in calls] == ["get_weather"] and calls[0].index == 0
    assert streamed[-1].choices[0].finish_reason == "tool_calls"

    city = chat_request("Give me a city as JSON.", max_tokens=100)
    city.response_format.type = "json_schema"
    city.response_format.json_schema.name = "city"
    city.response_format.json_schema.strict = True
    city.response_format.json_schema.schema.update(CITY_SCHEMA)   # maxLength 24: an integer, kept one
    value = json.loads(api.ChatComplete(city, timeout=60).choices[0].message.content)
    assert set(value) == {"name", "population"} and isinstance(value["population"], int) and len(value["name"]) <= 24


def test_tokenize_round_trip_models_and_model_info(api, stack: Stack) -> None:
    text = "Tandem serves models over gRPC too."
    tokens = api.Tokenize(inference_service_pb2.TokenizeRequest(model=MODEL, prompt=text, return_token_strs=True))
    http = httpx.post(f"{stack.url}/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert (list(tokens.tokens), list(tokens.token_strs), tokens.count) == (http["tokens"], http["token_strs"],
                                                                            http["count"])
    assert tokens.max_model_len == 1024
    back = api.Detokenize(inference_service_pb2.DetokenizeRequest(model=MODEL, tokens=tokens.tokens))
    assert back.prompt == text
    chat = inference_service_pb2.TokenizeRequest(model=MODEL)
    chat.messages.add(role="user", content=text)
    templated = api.Tokenize(chat).tokens
    assert len(templated) > len(tokens.tokens)
    assert httpx.post(f"{stack.url}/tokenize", json={"model": MODEL, "messages": [
        {"role": "user", "content": text}]}).json()["tokens"] == list(templated)
    (model,) = api.ListModels(inference_service_pb2.ListModelsRequest()).data
    assert (model.id, model.object, model.max_model_len) == (MODEL, "model", 1024)
    info = api.GetModelInfo(inference_service_pb2.GetModelInfoRequest())
    assert info.is_generation and info.model_path == httpx.get(f"{stack.url}/get_model_info").json()["model_path"]


def test_reflection_lists_and_describes_the_service(stack: Stack) -> None:
    with grpc.insecure_channel(stack.grpc_target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"tandem.api.v1.InferenceService", "grpc.health.v1.Health"} <= services
        service = descriptor_pool.DescriptorPool(database).FindServiceByName("tandem.api.v1.InferenceService")
        assert [m.name for m in service.methods] == [
            "ChatComplete", "ChatCompleteStream", "Complete", "CompleteStream", "Generate", "GenerateStream",
            "Embed", "Classify", "Score", "Rerank", "Tokenize", "Detokenize", "ListModels", "GetModelInfo", "Abort"]
        assert service.methods_by_name["ChatCompleteStream"].output_type.full_name == "tandem.api.v1.ChatCompletionChunk"
