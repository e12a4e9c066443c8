"""--skip-tokenizer-init: a model with no tokenizer files at all serves token ids in and out."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.stack import Stack, start_stack
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenless(tmp_path_factory) -> Stack:
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")   # weights and config only
    stack = start_stack(tmp_path_factory.mktemp("tokenless"), "--model-path", str(model), "--skip-tokenizer-init",
                        "--dtype", "float32", "--max-total-tokens", "1024", "--torch-threads", "1")
    yield stack
    assert stack.stop() == []


def test_input_ids_in_token_ids_out_as_in_the_seed(tokenless: Stack) -> None:
    body = {"input_ids": [5, 17, 42, 99], "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                                                                "stop_token_ids": [2]}, "stream": False}
    output = httpx.post(f"{tokenless.url}/generate", json=body, timeout=60).json()
    assert "text" not in output and output["token_ids"] == output["output_ids"]
    assert 1 <= len(output["token_ids"]) <= 8
    assert output["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    again = httpx.post(f"{tokenless.url}/generate", json=body, timeout=60).json()
    assert again["token_ids"] == output["token_ids"]
    completion = httpx.post(f"{tokenless.url}/v1/completions", json={
        "model": tokenless_model(tokenless), "prompt": [5, 17, 42, 99], "max_tokens": 4, "temperature": 0}).json()
    assert completion["usage"]["completion_tokens"] >= 1


def tokenless_model(stack: Stack) -> str:
    return httpx.get(f"{stack.url}/v1/models").json()["data"][0]["id"]


def test_anything_that_needs_text_is_a_clear_400(tokenless: Stack) -> None:
    model = tokenless_model(tokenless)
    for path, body, param in (
            ("/generate", {"text": "hi"}, "text"),
            ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]}, "messages"),
            ("/v1/completions", {"model": model, "prompt": "hi"}, "prompt"),
            ("/generate", {"input_ids": [5, 6], "sampling_params": {"stop": ["x"], "max_new_tokens": 4}},
             "sampling_params.stop")):
        response = httpx.post(f"{tokenless.url}{path}", json=body)
        assert response.status_code == 400, path
        assert response.json()["error"]["param"] == param
        assert "--skip-tokenizer-init" in response.json()["error"]["message"]
