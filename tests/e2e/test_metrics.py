"""Prometheus metrics on the three-process stack: the gateway's `/metrics` and each worker's own endpoint
move by exactly what the requests did."""

from __future__ import annotations

import time
import uuid

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.e2e.stack import WORKER_METADATA, Stack

pytestmark = pytest.mark.slow

NUM_TOKENS = 8


class Scrape:
    """One scrape of the gateway and both workers."""

    def __init__(self, stack: Stack) -> None:
        gateway = httpx.get(f"{stack.url}/metrics", timeout=5)
        assert gateway.status_code == 200 and gateway.headers["content-type"].startswith("text/plain")
        self.texts = {"gateway": gateway.text, "prefill": stack.worker_metrics("prefill"),
                      "decode": stack.worker_metrics("decode")}

    def value(self, source: str, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels` (0 when there is none yet)."""
        return sum(sample.value for family in text_string_to_metric_families(self.texts[source])
                   for sample in family.samples
                   if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def delta(before: Scrape, after: Scrape, source: str, name: str, **labels: str) -> float:
    return after.value(source, name, **labels) - before.value(source, name, **labels)


def generate(stack: Stack, text: str, **sampling) -> dict:
    reply = httpx.post(f"{stack.url}/generate", json={"text": text, "sampling_params": {
        "temperature": 0, **sampling}}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_requests_tokens_latencies_and_kv_transfer_are_counted_exactly(stack: Stack) -> None:
    before = Scrape(stack)
    metas = [generate(stack, f"Request {i}: tell me about the sea.", max_new_tokens=NUM_TOKENS,
                      ignore_eos=True)["meta_info"] for i in range(3)]
    assert httpx.post(f"{stack.url}/generate", json={}).status_code == 400
    assert httpx.get(f"{stack.url}/no/such/route").status_code == 404
    after = Scrape(stack)
    num_prompt = sum(m["prompt_tokens"] for m in metas)
    kv_bytes = sum(m["tandem_timings"]["kv_bytes"] for m in metas)
    assert kv_bytes > 0 and all(m["completion_tokens"] == NUM_TOKENS for m in metas)

    requests = "tandem_gateway_requests_total"
    assert delta(before, after, "gateway", requests, route="/generate", method="POST", status="200") == 3
    assert delta(before, after, "gateway", requests, route="/generate", method="POST", status="400") == 1
    assert delta(before, after, "gateway", requests, route="unmatched", method="GET", status="404") == 1
    assert delta(before, after, "gateway", requests, route="/metrics", method="GET", status="200") == 1
    assert after.value("gateway", "tandem_gateway_requests_in_flight") == 1   # the scrape itself
    assert after.value("gateway", "tandem_gateway_workers_ready", role="prefill") == 1
    assert after.value("gateway", "tandem_gateway_workers_ready", role="decode") == 1
    for name, expected in (("tandem_gateway_generations_total", 3),
                           ("tandem_gateway_time_to_first_token_seconds_count", 3),
                           ("tandem_gateway_e2e_request_latency_seconds_count", 3),
                           ("tandem_gateway_inter_token_latency_seconds_count", 3 * (NUM_TOKENS - 1)),
                           ("tandem_gateway_generation_tokens_total", 3 * NUM_TOKENS),
                           ("tandem_gateway_prompt_tokens_total", num_prompt),
                           ("tandem_gateway_kv_transfer_bytes_total", kv_bytes)):
        assert delta(before, after, "gateway", name) == expected, name
    assert delta(before, after, "gateway", "tandem_gateway_generations_total", outcome="length") == 3
    for phase in ("gateway_queue", "reserve", "prefill_queue", "prefill_compute", "kv_transfer", "decode_queue"):
        assert delta(before, after, "gateway", "tandem_gateway_handoff_phase_seconds_count", phase=phase) == 3
    assert delta(before, after, "gateway", "tandem_gateway_e2e_request_latency_seconds_sum") > 0

    worker_requests = "tandem_worker_requests_total"
    assert delta(before, after, "prefill", worker_requests, method="Prefill", code="OK") == 3
    assert delta(before, after, "decode", worker_requests, method="Reserve", code="OK") == 3
    assert delta(before, after, "decode", worker_requests, method="Generate", code="OK") == 3
    # prefill samples each request's first token, decode the rest
    assert delta(before, after, "prefill", "tandem_worker_generation_tokens_total") == 3
    assert delta(before, after, "decode", "tandem_worker_generation_tokens_total") == 3 * (NUM_TOKENS - 1)
    assert delta(before, after, "prefill", "tandem_worker_prompt_tokens_total") == num_prompt
    assert delta(before, after, "prefill", "tandem_worker_kv_transfer_bytes_total") == kv_bytes
    assert delta(before, after, "prefill", "tandem_worker_kv_transfer_seconds_count") == 3
    assert delta(before, after, "prefill", "tandem_worker_step_seconds_count") >= 1
    assert delta(before, after, "decode", "tandem_worker_step_seconds_count") >= NUM_TOKENS - 1
    assert delta(before, after, "decode", "tandem_worker_step_batch_size_count") >= NUM_TOKENS - 1
    for role in ("prefill", "decode"):
        assert after.value(role, "tandem_worker_info", role=role) == 1


def test_queue_depths_and_kv_pages_settle_when_idle(stack: Stack) -> None:
    generate(stack, "Hello there", max_new_tokens=4)
    deadline = time.monotonic() + 5
    while True:   # the engine thread refreshes these gauges every 0.25 s
        scrape, loads = Scrape(stack), stack.load()
        pages = {role: {state: scrape.value(role, "tandem_worker_kv_pages", state=state)
                        for state in ("used", "free", "cached")} for role in ("prefill", "decode")}
        expected = {role: {"used": 0, "free": load.num_free_pages, "cached": load.num_cached_pages}
                    for role, load in loads.items()}
        if pages == expected or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert pages == expected
    for role in ("prefill", "decode"):
        assert scrape.value(role, "tandem_worker_kv_pages_capacity") == loads[role].num_total_pages
        assert scrape.value(role, "tandem_worker_num_requests_running") == 0
        assert scrape.value(role, "tandem_worker_num_requests_waiting") == 0
        assert scrape.value(role, "tandem_worker_num_requests_loading") == 0
        assert scrape.value(role, "tandem_worker_num_kv_sends_running") == 0


def test_prefix_cache_hit_rate_after_a_repeated_prefix(stack: Stack) -> None:
    prefix = f"Session {uuid.uuid4().hex}. " + "The same long preamble, sentence after sentence. " * 12
    before = Scrape(stack)
    first = generate(stack, prefix + "First question?", max_new_tokens=1)["meta_info"]
    second = generate(stack, prefix + "Second question?", max_new_tokens=1)["meta_info"]
    after = Scrape(stack)
    assert first["cached_tokens"] == 0 and second["cached_tokens"] >= 16
    cached = first["cached_tokens"] + second["cached_tokens"]
    assert delta(before, after, "prefill", "tandem_worker_cached_prompt_tokens_total") == cached
    assert delta(before, after, "gateway", "tandem_gateway_cached_prompt_tokens_total") == cached
    assert delta(before, after, "prefill", "tandem_worker_prompt_tokens_total") == (
        first["prompt_tokens"] + second["prompt_tokens"])
    hit_rate = after.value("prefill", "tandem_worker_prefix_cache_hit_rate")
    assert hit_rate > 0
    assert hit_rate == pytest.approx(after.value("prefill", "tandem_worker_cached_prompt_tokens_total")
                                     / after.value("prefill", "tandem_worker_prompt_tokens_total"))


def test_failed_and_closed_requests_are_counted_with_their_status(stack: Stack) -> None:
    before = Scrape(stack)
    stopped = generate(stack, "The capital of France is", max_new_tokens=32, stop=[" "])
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
    with grpc.insecure_channel(f"127.0.0.1:{stack.decode_port}") as channel:
        stream = decode_pb2_grpc.DecodeServiceStub(channel).Generate(decode_pb2.GenerateRequest(
            request_id="never-reserved", prompt_token_ids=[1, 2, 3], first_token=common_pb2.TokenOutput(token_id=4),
            sampling_params=common_pb2.SamplingParams(max_new_tokens=2)), timeout=10, metadata=WORKER_METADATA)
        with pytest.raises(grpc.RpcError) as failure:
            list(stream)
    after = Scrape(stack)
    code = failure.value.code().name
    assert code != "OK"
    assert delta(before, after, "decode", "tandem_worker_requests_total", method="Generate", code=code) == 1
    # the stop string closed the handoff early: the decode server was told to drop the request
    assert delta(before, after, "gateway", "tandem_gateway_generations_total", outcome="closed") == 1
    assert delta(before, after, "decode", "tandem_worker_requests_total", method="Abort", code="OK") == 1
