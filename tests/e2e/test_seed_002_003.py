"""The code cells of seeds 002 and 003 (SGLang's native-API notebook, in English and in Chinese) that Tandem
supports today, as written there: only model names and paths and the port changed, `print_highlight` became
`print`, and launching or terminating a server is a fixture. Each test runs one cell (its seed cell numbers
in the name), keeps the seed's asserts, and then checks real properties of the answer.

Seed 003 repeats seed 002's cells 2-9 and 11 with other model names; the code is otherwise the same (002's
cell 8 adds a key-set assert), so each runs once, in 002's form. The `/classify` (002 cells 13-15,
003 cells 14-16) and expert distribution (003 cells 17-19) cells run in test_seed_classify_experts.py.

Model names: generation (meta-llama/Llama-3.2-1B-Instruct, qwen/qwen2.5-0.5b-instruct) -> the bundled
SmolLM2 GGUF; update-weights success (meta-llama/Llama-3.2-1B) -> the same SmolLM2 file; the failure case ->
its path + "-wrong", as the seeds append "-wrong" to a model name; embedding (Alibaba-NLP/gte-Qwen2-*) ->
all-MiniLM-L6-v2. The tokenizer-free cell loads the client tokenizer from the GGUF (`gguf_file=`).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import requests
from transformers import AutoTokenizer

from tests.conftest import minilm_dir, smollm2_gguf
from tests.e2e.stack import Stack, start_stack

pytestmark = pytest.mark.slow

MODEL = str(smollm2_gguf())
EMBEDDING_MODEL = str(minilm_dir())
FLUSH_NOTE = ("Please check backend logs for more details. (When there are running or waiting requests, "
              "the operation will not be performed.)")


@pytest.fixture(scope="module")
def port(stack: Stack) -> int:
    """The generation server of cells 1-9 (`launch_server_cmd(... --model-path MODEL)`): the shared stack."""
    return stack.port


@pytest.fixture(scope="module")
def other_servers(tmp_path_factory) -> dict[str, Stack]:
    """Cell 10 (`--is-embedding`) and cell 16 (`--skip-tokenizer-init`, with the shared stack's other flags,
    so that answers can be compared), started side by side to save a start-up."""
    launches = {
        "embedding": (tmp_path_factory.mktemp("seed_embedding"), "--is-embedding", "--model-path", EMBEDDING_MODEL,
                      "--torch-threads", "1"),
        "tokenizer_free": (tmp_path_factory.mktemp("seed_tokenizer_free"), "--skip-tokenizer-init", "--dtype",
                           "float32", "--context-length", "1024", "--max-total-tokens", "8192", "--torch-threads", "1")}
    with ThreadPoolExecutor(len(launches)) as pool:
        futures = {name: pool.submit(start_stack, *args) for name, args in launches.items()}
    stacks = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        if len(stacks) < len(launches):
            raise next(f.exception() for f in futures.values() if f.exception() is not None)
        yield stacks
    finally:
        with ThreadPoolExecutor(len(launches)) as pool:
            survivors = [pid for pids in pool.map(Stack.stop, stacks.values()) for pid in pids]
        assert survivors == []


@pytest.fixture(scope="module")
def embedding_port(other_servers: dict[str, Stack]) -> int:
    return other_servers["embedding"].port


@pytest.fixture(scope="module")
def tokenizer_free_port(other_servers: dict[str, Stack]) -> int:
    return other_servers["tokenizer_free"].port


def test_cell_2_generate(port: int) -> None:
    url = f"http://localhost:{port}/generate"
    data = {"text": "What is the capital of France?"}

    response = requests.post(url, json=data)
    print(response.json())

    body = response.json()
    assert response.status_code == 200 and body.keys() == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"} <= meta.keys()
    assert isinstance(body["text"], str) and meta["completion_tokens"] == len(body["output_ids"]) >= 1
    assert meta["prompt_tokens"] > 0 and 0 <= meta["cached_tokens"] < meta["prompt_tokens"]
    finish = meta["finish_reason"]
    assert finish in ({"type": "stop", "matched": body["output_ids"][-1]},   # eos (SmolLM2 may answer it at once)
                      {"type": "length", "length": 128})                     # SGLang's default budget
    again = requests.post(url, json=data).json()     # the bundled model's default sampling is greedy
    assert again["output_ids"] == body["output_ids"] and again["meta_info"]["id"] != meta["id"]


def test_cell_3_get_model_info(port: int) -> None:
    url = f"http://localhost:{port}/get_model_info"

    response = requests.get(url)
    response_json = response.json()
    print(response_json)
    assert response_json["model_path"] == MODEL
    assert response_json["is_generation"] is True
    assert response_json["tokenizer_path"] == MODEL
    assert response_json.keys() == {"model_path", "is_generation", "tokenizer_path"}


def test_cell_4_get_server_info(port: int) -> None:
    # get_server_info

    url = f"http://localhost:{port}/get_server_info"

    response = requests.get(url)
    print(response.text)

    info = response.json()
    assert response.status_code == 200 and info["model_path"] == MODEL and info["port"] == port
    assert sorted(w["role"] for w in info["workers"]) == ["decode", "prefill"]
    for worker in info["workers"]:
        assert worker["ready"] and worker["max_total_num_tokens"] > 0 and worker["kv_pool_bytes"] > 0


def test_cells_5_6_health_generate_and_health(port: int) -> None:
    url = f"http://localhost:{port}/health_generate"

    response = requests.get(url)
    print(response.text)
    assert response.status_code == 200 and response.json() == {"status": "ok"}

    url = f"http://localhost:{port}/health"

    response = requests.get(url)
    print(response.text)
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_cell_7_flush_cache(port: int, stack: Stack) -> None:
    requests.post(f"http://localhost:{port}/generate", json={
        "text": "A prompt long enough to leave full pages in the prefix cache. " * 4,
        "sampling_params": {"max_new_tokens": 1}})
    assert stack.load()["prefill"].num_cached_pages > 0

    # flush cache

    url = f"http://localhost:{port}/flush_cache"

    response = requests.post(url)
    print(response.text)

    assert response.status_code == 200 and response.text.strip() == f"Cache flushed.\n{FLUSH_NOTE}"
    assert stack.load()["prefill"].num_cached_pages == 0


def test_cell_8_update_weights_from_disk_succeeds(port: int) -> None:
    before = requests.post(f"http://localhost:{port}/generate", json={
        "text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}).json()

    # successful update with same architecture and size

    url = f"http://localhost:{port}/update_weights_from_disk"
    data = {"model_path": MODEL}

    response = requests.post(url, json=data)
    print(response.text)
    assert response.json()["success"] is True
    assert response.json()["message"] == "Succeeded to update model weights."
    assert response.json().keys() == {"success", "message"}

    after = requests.post(f"http://localhost:{port}/generate", json={
        "text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}).json()
    assert after["output_ids"] == before["output_ids"]    # the same weights, reloaded: the same greedy answer


def test_cell_9_update_weights_from_disk_fails_for_a_wrong_name(port: int) -> None:
    # failed update with different parameter size or wrong name

    url = f"http://localhost:{port}/update_weights_from_disk"
    data = {"model_path": f"{MODEL}-wrong"}

    response = requests.post(url, json=data)
    response_json = response.json()
    print(response_json)
    assert response_json["success"] is False
    assert response_json["message"] == (
        "Failed to get weights iterator: "
        f"{MODEL}-wrong"
        " (repository not found)."
    )

    assert response.status_code == 400 and response_json.keys() == {"success", "message"}
    assert requests.get(f"http://localhost:{port}/health_generate").status_code == 200   # old weights serve on


def test_cell_11_encode(embedding_port: int) -> None:
    port = embedding_port
    # successful encode for embedding model

    url = f"http://localhost:{port}/encode"
    data = {"model": EMBEDDING_MODEL, "text": "Once upon a time"}

    response = requests.post(url, json=data)
    response_json = response.json()
    print(f"Text embedding (first 10): {response_json['embedding'][:10]}")

    assert response.status_code == 200 and len(response_json["embedding"]) == 384
    assert math.isclose(math.fsum(x * x for x in response_json["embedding"]), 1.0, rel_tol=1e-4)  # normalized
    openai_form = requests.post(f"http://localhost:{port}/v1/embeddings", json={
        "model": EMBEDDING_MODEL, "input": "Once upon a time"}).json()
    assert openai_form["data"][0]["embedding"] == pytest.approx(response_json["embedding"], abs=1e-6)


def test_cell_17_skip_tokenizer_init(tokenizer_free_port: int, port: int) -> None:
    generation_port, port = port, tokenizer_free_port
    gguf = Path(MODEL)

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    input_text = "What is the capital of France?"

    input_tokens = tokenizer.encode(input_text)
    print(f"Input Text: {input_text}")
    print(f"Tokenized Input: {input_tokens}")

    response = requests.post(
        f"http://localhost:{port}/generate",
        json={
            "input_ids": input_tokens,
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": 256,
                "stop_token_ids": [tokenizer.eos_token_id],
            },
            "stream": False,
        },
    )
    output = response.json()
    output_tokens = output["token_ids"]

    output_text = tokenizer.decode(output_tokens, skip_special_tokens=False)
    print(f"Tokenized Output: {output_tokens}")
    print(f"Decoded Output: {output_text}")
    print(f"Output Text: {output['meta_info']['finish_reason']}")

    assert response.status_code == 200 and "text" not in output and output["output_ids"] == output_tokens
    assert output_text.strip() and all(isinstance(t, int) for t in output_tokens)
    finish = output["meta_info"]["finish_reason"]
    assert finish in ({"type": "stop", "matched": tokenizer.eos_token_id}, {"type": "length", "length": 256})
    if finish["type"] == "stop":     # the matched stop token is the last one, as in the seed's output
        assert output_tokens[-1] == tokenizer.eos_token_id
    # The tokenizer-free server computes exactly what the full server does for the same ids.
    with_tokenizer = httpx.post(f"http://127.0.0.1:{generation_port}/generate", json={
        "input_ids": input_tokens, "sampling_params": {
            "temperature": 0, "max_new_tokens": 256, "stop_token_ids": [tokenizer.eos_token_id]}}, timeout=120).json()
    assert with_tokenizer["output_ids"] == output_tokens
    # The raw question gets an eos at once; through the chat template both servers answer at length, alike.
    chat_text = tokenizer.apply_chat_template([{"role": "user", "content": input_text}], tokenize=False,
                                              add_generation_prompt=True)
    chat_ids = tokenizer.encode(chat_text, add_special_tokens=False)
    answers = [httpx.post(f"http://127.0.0.1:{p}/generate", json={"input_ids": chat_ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": 16}}, timeout=120).json() for p in (port, generation_port)]
    assert answers[0]["token_ids"] == answers[1]["output_ids"] and len(answers[0]["token_ids"]) > 1
    assert tokenizer.decode(answers[0]["token_ids"], skip_special_tokens=True) == answers[1]["text"]
    assert "Paris" in answers[1]["text"]
