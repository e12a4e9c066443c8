"""SGLang's admin routes on the three-process stack: model info, server info, health_generate, flush."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.e2e.conftest import CONTEXT_LEN
from tests.e2e.stack import Stack

pytestmark = pytest.mark.slow


def test_get_model_info_has_exactly_sglangs_keys(stack: Stack) -> None:
    info = httpx.get(f"{stack.url}/get_model_info").json()
    assert info.keys() == {"model_path", "is_generation", "tokenizer_path"}
    assert info["is_generation"] is True and info["model_path"].endswith(".gguf")


def test_get_server_info_lists_the_gateway_args_and_every_worker(stack: Stack) -> None:
    info = httpx.get(f"{stack.url}/get_server_info").json()
    assert info["served_model_name"] == "SmolLM2-135M-Instruct" and "api_key" not in info
    roles = sorted(w["role"] for w in info["workers"])
    assert roles == ["decode", "prefill"]
    for worker in info["workers"]:
        assert worker["context_len"] == CONTEXT_LEN and worker["max_total_num_tokens"] == 8192
        assert 0 <= worker["kv_pool_usage"] <= 1 and worker["version"] == info["version"]


def test_health_generate_runs_one_token_through_the_whole_path(stack: Stack) -> None:
    assert httpx.get(f"{stack.url}/health_generate", timeout=60).json() == {"status": "ok"}


def test_flush_cache_flushes_when_idle_and_refuses_while_requests_run(stack: Stack) -> None:
    text = "Repeat after me: " + "a long shared prefix for the cache " * 20
    httpx.post(f"{stack.url}/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
    assert stack.load()["prefill"].num_cached_pages > 0
    flushed = httpx.post(f"{stack.url}/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    assert stack.load()["prefill"].num_cached_pages == 0
    busy = threading.Thread(target=httpx.post, args=(f"{stack.url}/generate",), kwargs={
        "json": {"text": "Count to one hundred:", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}},
        "timeout": 120})
    busy.start()
    try:
        for _ in range(100):
            if stack.load()["decode"].num_running:
                break
            threading.Event().wait(0.05)
        refused = httpx.post(f"{stack.url}/flush_cache")
        assert refused.status_code == 400 and refused.text.startswith("Cache not flushed")
    finally:
        busy.join()


def test_update_weights_from_disk_as_in_the_seed(stack: Stack) -> None:
    model_path = httpx.get(f"{stack.url}/get_model_info").json()["model_path"]
    before = httpx.post(f"{stack.url}/generate", json={"text": "The capital of France is",
                                                       "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    ok = httpx.post(f"{stack.url}/update_weights_from_disk", json={"model_path": model_path}, timeout=300)
    assert ok.json() == {"success": True, "message": "Succeeded to update model weights."}
    assert ok.json().keys() == {"success", "message"}
    after = httpx.post(f"{stack.url}/generate", json={"text": "The capital of France is",
                                                      "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    assert after.json()["text"] == before.json()["text"]   # same weights reloaded: same answer
    wrong = httpx.post(f"{stack.url}/update_weights_from_disk", json={"model_path": "meta-llama/Llama-3.2-1B-wrong"})
    assert wrong.json() == {"success": False, "message": "Failed to get weights iterator: "
                                                         "meta-llama/Llama-3.2-1B-wrong (repository not found)."}


def test_update_weights_with_other_shapes_fails_cleanly_and_old_weights_keep_serving(stack: Stack,
                                                                                      tmp_path) -> None:
    from tests.tiny_models import save_tiny_llama
    tiny = save_tiny_llama(tmp_path / "tiny")
    before = httpx.post(f"{stack.url}/generate", json={"text": "Hello", "sampling_params": {
        "temperature": 0, "max_new_tokens": 6}}).json()["text"]
    refused = httpx.post(f"{stack.url}/update_weights_from_disk", json={"model_path": str(tiny)}, timeout=120)
    assert refused.status_code == 400 and refused.json()["success"] is False
    assert "do not match" in refused.json()["message"]
    assert httpx.post(f"{stack.url}/generate", json={"text": "Hello", "sampling_params": {
        "temperature": 0, "max_new_tokens": 6}}).json()["text"] == before
