"""The two checks every chaos scenario ends with (docs: ../shared/research/reliability.md, section 5).

"Nothing leaked": on every worker asked about, each KV page is free or kept only by the prefix cache
and no request runs or waits (GetLoad); the gateway has no request in flight but the scrape reading
its /metrics, and none queued. "Still serving": /health is 200 and a greedy canary gives, byte for
byte, the text it gave before the fault.
"""

from __future__ import annotations

import time

import grpc
import httpx

from tandem.v1 import common_pb2, worker_pb2_grpc
from tests.e2e.stack import WORKER_METADATA, wait_health

CANARY = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
ROLES = ("prefill", "decode")


def canary(url: str) -> str:
    """The greedy canary's text (200 required)."""
    reply = httpx.post(f"{url}/generate", json=CANARY, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["text"]


def assert_still_serving(url: str, baseline: str, within_s: float = 30) -> None:
    """/health turns 200 within `within_s` and the canary gives `baseline` again."""
    wait_health(url, 200, timeout_s=within_s)
    assert canary(url) == baseline


def worker_load(port: int) -> common_pb2.GetLoadResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return worker_pb2_grpc.WorkerServiceStub(channel).GetLoad(
            common_pb2.GetLoadRequest(), timeout=30, metadata=WORKER_METADATA)   # waits for a step to end


def leaks(services, roles: tuple[str, ...] = ROLES) -> dict[str, str]:
    """What is still held now, by place ("prefill", "decode", "gateway"); {} when nothing is."""
    found = {}
    for role in roles:
        load = worker_load(services.prefill_port if role == "prefill" else services.decode_port)
        held = load.num_total_pages - load.num_free_pages - load.num_cached_pages
        if held or load.num_running or load.num_waiting:
            found[role] = f"{held} pages held, {load.num_running} running, {load.num_waiting} waiting"
    if services.gateway is not None and services.gateway.poll() is None:
        metrics = gateway_metrics(services.url)
        # the scrape itself is in flight while the gauge is read
        if metrics.get("tandem_gateway_requests_in_flight", 0) > 1 or metrics.get("tandem_gateway_queued_requests"):
            found["gateway"] = (f"{metrics.get('tandem_gateway_requests_in_flight')} in flight (1 is the scrape), "
                                f"{metrics.get('tandem_gateway_queued_requests')} queued")
    return found


def assert_nothing_leaked(services, within_s: float = 5.0, roles: tuple[str, ...] = ROLES) -> float:
    """Wait until `leaks` finds nothing (on the workers of `roles` and a live gateway); returns the
    seconds it took. Fails with what is still held after `within_s`."""
    started = time.monotonic()
    while found := leaks(services, roles):
        if time.monotonic() - started > within_s:
            raise AssertionError(f"still held {within_s} s after the fault: {found}")
        time.sleep(0.1)
    return time.monotonic() - started


def gateway_metrics(url: str) -> dict[str, float]:
    """The gateway's unlabelled Prometheus samples, by name."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()[:2]
            samples[name] = float(value)
    return samples
