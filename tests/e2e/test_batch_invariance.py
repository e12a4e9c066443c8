"""Batch-invariant greedy through the three processes in the default configuration (both workers on
the bundled GGUF's packed weights with float32 rows and a bfloat16 KV pool, as `auto` resolves them on
CPU; the fused C++ layers; the prefix cache on): 16 concurrent streams give exactly the texts the
same 16 requests give one at a time."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.stack import Stack, start_stack

TOPICS = ["the sea", "a cat", "mountains", "coffee", "the moon", "trains", "rain", "a library", "bread",
          "winter", "a garden", "the desert", "music", "a bridge", "stars", "autumn"]
MAX_TOKENS = 24

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory) -> Stack:
    stack = start_stack(tmp_path_factory.mktemp("default-stack"), "--context-length", "1024")
    yield stack
    stack.stop()


def _complete(url: str, topic: str) -> tuple[str, str]:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Write one sentence about {topic}."}]}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def test_sixteen_concurrent_streams_give_the_texts_they_give_one_at_a_time(default_stack: Stack) -> None:
    log = default_stack.log_path.read_text()
    # the default really is the packed decode path and the C++ attention kernel
    for role in ("prefill", "decode"):
        assert re.search(rf"\[{role}\] .* model on cpu: dtype float32, quantization gguf .* attention cpu", log)
        assert re.search(rf"\[{role}\] .* 30 of 30 layers fused", log)
        assert re.search(rf"\[{role}\] .* KV pool: .* bfloat16", log)
    alone = [_complete(default_stack.url, topic) for topic in TOPICS]
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        together = list(pool.map(lambda topic: _complete(default_stack.url, topic), TOPICS))
    assert all(reason == "length" for _, reason in alone + together)
    assert len({text for text, _ in alone}) > 8      # real, different continuations
    differing = [topic for topic, a, b in zip(TOPICS, alone, together) if a != b]
    assert not differing, f"batching changed the greedy text for {differing}"
    default_stack.assert_no_pages_held()
