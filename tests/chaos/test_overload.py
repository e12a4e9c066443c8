"""Overload: generations that do not fit in the decode pool now wait their turn and then run; only a
full queue is refused, with a real 503 and Retry-After, streams included; generations that outgrow
the pool while decoding are preempted and recomputed, with the greedy output they have alone; an
abort storm leaks nothing (a 16-page decode pool, fp32)."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.stack import Stack, start_stack

pytestmark = pytest.mark.slow

MAX_QUEUED = 8
# 22-23 prompt tokens + 8 new fit the two pages reserved for the prompt (page size 16): no decode page
# is needed beyond the reservation, so the pool's 16 pages run 8 generations at once.
PROMPT = "Write one short sentence about the number {i} and nothing else. Do not add any other words or lines."


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    stack = start_stack(tmp_path_factory.mktemp("overload"), "--max-total-tokens", "256", "--dtype", "float32",
                        "--quantization", "none",
                        "--torch-threads", "1", "--max-queued-requests", str(MAX_QUEUED), "--max-queue-wait", "120")
    yield stack
    assert stack.stop() == []


def _request(stack: Stack, i: int, stream: bool) -> tuple[int, dict[str, str], str]:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT.format(i=i), "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    reply = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=300)
    return reply.status_code, dict(reply.headers), reply.text


def _metric(stack: Stack, name: str) -> float:
    text = httpx.get(f"{stack.url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_what_does_not_fit_now_waits_and_then_runs(stack: Stack) -> None:
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda i: _request(stack, i, stream=i % 2 == 1), range(16)))
    assert [status for status, _, _ in replies] == [200] * 16
    for i, (_, _, text) in enumerate(replies):
        if i % 2:
            events = [line for line in text.splitlines() if line.startswith("data:")]
            assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
        else:
            choice = json.loads(text)["choices"][0]
            assert choice["finish_reason"] == "length" and json.loads(text)["usage"]["completion_tokens"] == 8
    assert _metric(stack, "tandem_gateway_queue_wait_seconds_count") >= 1   # some of them waited
    stack.assert_no_pages_held()


def test_a_full_queue_is_a_real_503_with_retry_after_streams_included(stack: Stack) -> None:
    with ThreadPoolExecutor(48) as pool:
        replies = list(pool.map(lambda i: _request(stack, i, stream=i % 2 == 1), range(48)))
    refused = [(status, headers, text) for status, headers, text in replies if status != 200]
    assert refused and len(refused) < 48
    for status, headers, text in refused:
        assert status == 503 and int(headers["retry-after"]) >= 1
        assert json.loads(text)["error"]["code"] == "queue_full"
    streams_refused = [i for i, (status, _, _) in enumerate(replies) if status == 503 and i % 2]
    assert streams_refused, "a refused stream must get its 503 before any byte"
    assert _metric(stack, 'tandem_gateway_admission_refused_total{reason="queue_full"}') == len(refused)
    stack.assert_no_pages_held()
    assert _request(stack, 0, stream=False)[0] == 200   # still serving


def test_generations_that_outgrow_the_pool_are_preempted_and_keep_their_greedy_output(stack: Stack) -> None:
    """Each of 8 generations reserves 2 pages and grows to 4 (22 + 40 tokens): 32 pages of a 16-page
    pool. None is aborted; each equals its output alone."""
    def complete(i: int) -> dict:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT.format(i=i), "max_tokens": 40,
                "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=600)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]

    alone = {i: complete(i)["text"] for i in range(4)}
    before = _worker_metric(stack, "tandem_worker_preemptions")
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(complete, [i % 4 for i in range(8)]))
    assert _worker_metric(stack, "tandem_worker_preemptions") > before
    for i, choice in enumerate(together):
        assert choice["finish_reason"] == "length" and choice["text"] == alone[i % 4], i
    stack.assert_no_pages_held()


def _worker_metric(stack: Stack, name: str) -> float:
    return sum(float(line.split()[-1]) for line in stack.worker_metrics("decode").splitlines()
               if line.startswith(name + " "))


def test_an_abort_storm_leaks_nothing_and_the_canary_is_unchanged(stack: Stack) -> None:
    """48 streams, each dropped by its client at a random moment in its first 3 s (queued, prefilling,
    handing off or decoding): afterwards no page is held, no request runs or waits anywhere, and a
    greedy canary gives its baseline text."""
    canary = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8,
              "temperature": 0}
    baseline = httpx.post(f"{stack.url}/v1/completions", json=canary, timeout=120).json()["choices"][0]["text"]
    rng = random.Random(7)
    delays = [rng.uniform(0.05, 3.0) for _ in range(48)]

    def dropped(i: int) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT.format(i=i), "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "stream": True}
        deadline = time.monotonic() + delays[i]
        try:
            with httpx.stream("POST", f"{stack.url}/v1/completions", json=body,
                              timeout=httpx.Timeout(60, read=delays[i])) as response:
                for _ in response.iter_lines():
                    if time.monotonic() > deadline:
                        return   # leaving the block closes the connection
        except httpx.ReadTimeout:
            pass

    with ThreadPoolExecutor(48) as pool:
        list(pool.map(dropped, range(48)))
    stack.assert_no_pages_held(within_s=15)
    loads = stack.load()
    assert all(l.num_running == 0 and l.num_waiting == 0 for l in loads.values()), loads
    assert _metric(stack, "tandem_gateway_queued_requests") == 0
    after = httpx.post(f"{stack.url}/v1/completions", json=canary, timeout=120).json()["choices"][0]["text"]
    assert after == baseline
