"""Three real processes (`tandem serve`): gateway -> prefill -> Mooncake TCP -> decode -> gateway."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from gateway.text.tokenizer import load_tokenizer
from tests.e2e.stack import WORKER_METADATA, Stack
from tests.hf_oracle import greedy_reference, hf_greedy, load_hf_smollm2

pytestmark = pytest.mark.slow

from tests.e2e.conftest import CONTEXT_LEN, MODEL

TOPICS = ["the sea", "a cat", "mountains", "coffee", "the moon", "trains", "rain", "a library",
          "bread", "winter", "a garden", "the desert", "music", "a bridge", "stars", "autumn"]


def test_seed_chat_request_answers_paris(stack: Stack) -> None:
    # exactly the seed's curl: a JSON body sent without a JSON content type
    raw = subprocess.check_output(
        ["curl", "-s", f"{stack.url}/v1/chat/completions", "-d",
         json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}]})])
    response = json.loads(raw)
    assert response["object"] == "chat.completion"
    [choice] = response["choices"]
    assert "Paris" in choice["message"]["content"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "stop"
    assert choice["matched_stop"] == 2
    usage = response["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_unset_temperature_takes_the_bundled_models_greedy_default(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    texts = {client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8).choices[0].message.content
             for _ in range(3)}
    assert len(texts) == 1
    sampled = {client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.5,
                                              seed=s).choices[0].message.content for s in range(4)}
    assert len(sampled) > 1   # an explicit temperature is honoured


def test_greedy_outputs_through_the_gateway_equal_hf(stack: Stack, smollm2_path: Path) -> None:
    tokenizer = load_tokenizer(str(smollm2_path))
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    ids = [tokenizer.encode(prompt) for prompt in prompts]
    references = greedy_reference(smollm2_path, "hf_greedy", ids, 16,
                                  lambda: [hf_greedy(load_hf_smollm2(smollm2_path), one, 16) for one in ids])
    for prompt, expected in zip(prompts, references):
        body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}}
        response = httpx.post(f"{stack.url}/generate", json=body, timeout=120).json()
        assert response["output_ids"] == expected, prompt
        assert response["text"] == tokenizer.decode(expected)
        assert response["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
        assert response["meta_info"]["completion_tokens"] == 16


def _stream_chat(client: openai.OpenAI, topic: str) -> str:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Write one sentence about {topic}."}],
        temperature=0, max_tokens=20, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_sixteen_concurrent_streams_equal_one_at_a_time(client: openai.OpenAI) -> None:
    alone = [_stream_chat(client, topic) for topic in TOPICS]
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        together = list(pool.map(lambda t: _stream_chat(client, t), TOPICS))
    assert together == alone
    assert all(text for text in alone)


def test_prompt_longer_than_context_is_rejected_before_any_worker_allocates(stack: Stack) -> None:
    before = stack.load()
    prompt = "hello " * (CONTEXT_LEN + 50)
    response = httpx.post(f"{stack.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert str(CONTEXT_LEN) in error["message"]
    after = stack.load()
    assert [l.num_free_pages for l in after.values()] == [l.num_free_pages for l in before.values()]


def test_prompt_plus_max_tokens_over_context_is_rejected(stack: Stack) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT_LEN}
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_model_is_404(stack: Stack) -> None:
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=body)
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_invalid_values_are_400_naming_the_param(stack: Stack) -> None:
    for field, value in (("temperature", -1), ("top_p", 0), ("max_tokens", 0)):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: value}
        response = httpx.post(f"{stack.url}/v1/chat/completions", json=body)
        assert response.status_code == 400, field
        assert response.json()["error"]["param"] == field


def test_stop_string_is_not_in_the_output(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0)
    assert " 5" in free.choices[0].text
    stopped = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0,
                                        stop=[" 5"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free.choices[0].text.split(" 5")[0]


def test_client_that_disconnects_mid_stream_leaves_no_pages(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # leaving the block closes the connection; the autouse fixture checks every page comes back


def test_client_that_disconnects_during_prefill_frees_the_decode_pages_at_once(stack: Stack) -> None:
    """Gone while its long prompt is still in the prefill worker: the prefill worker confirms the
    write is over once its current step ends, so the decode reservation is freed then, not after the
    30 s write grace (20 s allowed: a step of this prompt takes seconds on a loaded machine)."""
    prompt = "Once upon a time, " * 180   # about 900 tokens: seconds of fp32 prefill on one thread
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "stream": True}
    with pytest.raises(httpx.ReadTimeout):   # a stream answers once its first token is ready: leave before
        httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    stack.assert_no_pages_held(within_s=20)


def test_seed_openai_client_streaming_and_native_stream(stack: Stack, client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "List 3 countries and their capitals."}],
        temperature=0, max_tokens=64)
    assert response.choices[0].message.content and response.usage.completion_tokens <= 64
    with httpx.stream("POST", f"{stack.url}/generate", json={
            "text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8},
            "stream": True}) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    texts = [json.loads(e[5:])["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))   # cumulative text, as in the seed
    assert "Paris" in texts[-1]


def test_workers_serve_health_reflection_and_model_info(stack: Stack) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from tandem.v1 import common_pb2, worker_pb2_grpc
    for port, service, role in (
            (stack.prefill_port, "tandem.v1.PrefillService", common_pb2.WORKER_ROLE_PREFILL),
            (stack.decode_port, "tandem.v1.DecodeService", common_pb2.WORKER_ROLE_DECODE)):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for name in (service, "tandem.v1.WorkerService"):
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name))
                assert health.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=WORKER_METADATA)
            names = {s.name for s in next(reflection).list_services_response.service}
            assert {service, "tandem.v1.WorkerService", "grpc.health.v1.Health"} <= names
            control = worker_pb2_grpc.WorkerServiceStub(channel)
            info = control.GetModelInfo(common_pb2.GetModelInfoRequest(), metadata=WORKER_METADATA)
            assert (info.role, info.context_len, info.architecture) == (role, CONTEXT_LEN, "LlamaForCausalLM")
            assert not control.Abort(common_pb2.AbortRequest(request_id="nothing-here"), metadata=WORKER_METADATA).found


def test_models_and_health(stack: Stack) -> None:
    models = httpx.get(f"{stack.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{stack.url}/health").status_code == 200
