"""`tandem serve` (gateway, prefill and decode processes) on the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M
file with the CPU defaults for a GGUF file (packed blocks where a kernel exists, a bfloat16 KV pool): the
seeds' chat completion, completion and native `/generate` requests (000 cells 2, 4 and 5; 001 cells 2 and 6)
as written there, with only the model name and port changed, answered in the seeds' shapes with coherent,
greedy text. Unset temperatures are greedy here (`--default-sampling`), as for the bundled model."""

from __future__ import annotations

import json
import subprocess

import openai
import pytest
import requests

from tests.e2e.stack import Stack, start_stack
from tests.real_models import QWEN_0_5B, real_model_path

pytestmark = pytest.mark.slow

IM_END = 151645  # Qwen's end-of-turn token: where a chat answer stops
CAPITALS = ("Paris", "Tokyo", "Berlin", "Rome", "Madrid", "London", "Beijing", "Ottawa", "Canberra", "Washington",
            "Brasília", "Brasilia", "Moscow", "New Delhi", "Cairo", "Mexico City", "Buenos Aires", "Seoul")


@pytest.fixture(scope="module")
def model() -> str:
    """The served model's name: its path, as `tandem serve --model-path` names it."""
    return str(real_model_path(QWEN_0_5B))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model: str) -> Stack:
    """This module's stack (in place of the shared SmolLM2 one, so the e2e page-leak check covers it)."""
    stack = start_stack(tmp_path_factory.mktemp("qwen_stack"), "--model-path", model, "--default-sampling",
                        '{"temperature": 0}', "--context-length", "2048", "--max-total-tokens", "8192",
                        "--torch-threads", "1", timeout_s=600)
    yield stack
    survivors = stack.stop()
    assert stack.proc.returncode == 0
    assert survivors == [], f"orphaned processes after Ctrl-C: {survivors}"


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="None")


def _capitals_in(text: str) -> set[str]:
    return {capital for capital in CAPITALS if capital in text}


def test_seed_001_cell_2_curl_chat_answers_paris_greedily(stack: Stack, model: str) -> None:
    curl_command = f"""
curl -s http://localhost:{stack.port}/v1/chat/completions \\
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'
"""
    response = json.loads(subprocess.check_output(curl_command, shell=True))
    print(response)

    assert response.keys() >= {"id", "object", "created", "model", "choices", "usage"}
    assert response["object"] == "chat.completion" and response["model"] == model
    [choice] = response["choices"]
    assert choice.keys() >= {"index", "message", "logprobs", "finish_reason", "matched_stop"}
    assert choice["message"]["role"] == "assistant" and "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == IM_END
    usage = response["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    again = json.loads(subprocess.check_output(curl_command, shell=True))
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]   # greedy: the same answer


def test_seed_000_cell_2_chat_lists_three_capitals(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are a helpful AI assistant"},
            {"role": "user", "content": "List 3 countries and their capitals."},
        ],
        temperature=0,
        max_tokens=64,
    )
    print(f"Response: {response}")

    [choice] = response.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert len(_capitals_in(choice.message.content)) >= 3, choice.message.content
    assert response.usage.completion_tokens <= 64


def test_seed_000_cell_4_streamed_chat_says_it_is_a_test(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say this is a test"}],
        stream=True,
    )
    pieces = []
    for chunk in stream:
        if chunk.choices[0].delta.content is not None:
            print(chunk.choices[0].delta.content, end="")
            pieces.append(chunk.choices[0].delta.content)

    assert len(pieces) > 1 and "test" in "".join(pieces).lower()


def test_seed_000_cell_5_completion_continues_the_prompt(client: openai.OpenAI, model: str) -> None:
    response = client.completions.create(
        model=model,
        prompt="List 3 countries and their capitals.",
        temperature=0,
        max_tokens=64,
        n=1,
        stop=None,
    )
    print(f"Response: {response}")

    [choice] = response.choices
    assert response.object == "text_completion" and choice.finish_reason in ("stop", "length")
    assert len(_capitals_in(choice.text)) >= 3, choice.text
    assert response.usage.completion_tokens <= 64


def test_seed_001_cell_6_generate_answers_paris(stack: Stack) -> None:
    response = requests.post(
        f"http://localhost:{stack.port}/generate",
        json={
            "text": "The capital of France is",
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": 32,
            },
        },
    )
    print(response.json())

    body = response.json()
    assert response.status_code == 200 and body.keys() == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"} <= meta.keys()
    assert meta["finish_reason"] == {"type": "length", "length": 32} and len(body["output_ids"]) == 32
    assert "Paris" in body["text"]
