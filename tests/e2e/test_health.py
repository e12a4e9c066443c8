"""The gateway's /health follows its decode worker: 503 within seconds of the process being killed, 200
again within seconds of it serving again on the same port, and requests then succeed."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.stack import Services, start_services

pytestmark = pytest.mark.slow

WORKER_FLAGS = ("--dtype", "float32", "--max-total-tokens", "2048", "--torch-threads", "1")
# The gateway polls every second with a 2 s probe timeout; a dead process refuses connections at once.
MAX_SECONDS_TO_NOTICE = 5.0
# Long enough down that gRPC's default reconnect backoff (1 s growing 1.6x per failure, up to 120 s) would
# leave the gateway blind to the restarted worker for well over MAX_SECONDS_TO_NOTICE.
SECONDS_DOWN = 10.0


@pytest.fixture()
def services(tmp_path) -> Services:
    services = start_services(tmp_path, *WORKER_FLAGS)
    try:
        services.start_gateway("--data-dir", str(tmp_path / "data"))
        yield services
    finally:
        services.stop()


def seconds_until_health(url: str, status: int, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == status:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"/health did not return {status} within {timeout_s} s")


def wait_for_grpc_health(port: int, timeout_s: float) -> None:
    """Until the worker on `port` answers its own gRPC health check (it is loading the model until then)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_reconnect_backoff_ms", 500)]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise AssertionError(f"the worker on port {port} did not start serving in {timeout_s} s")


def generate(url: str) -> httpx.Response:
    return httpx.post(f"{url}/generate", json={"text": "The capital of France is",
                                               "sampling_params": {"temperature": 0, "max_new_tokens": 4}}, timeout=60)


def test_health_follows_the_decode_worker_through_a_kill_and_a_restart(services: Services) -> None:
    before = generate(services.url)
    assert before.status_code == 200

    services.kill_decode()
    assert seconds_until_health(services.url, 503, timeout_s=MAX_SECONDS_TO_NOTICE) < MAX_SECONDS_TO_NOTICE
    unavailable = httpx.get(f"{services.url}/health")
    assert [(w["role"], w["ready"]) for w in unavailable.json()["workers"]] == [("prefill", True), ("decode", False)]
    assert str(services.decode_port) not in unavailable.text   # /health is open to all: no internal address
    refused = generate(services.url)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "worker_unavailable"

    time.sleep(SECONDS_DOWN)
    assert httpx.get(f"{services.url}/health").status_code == 503
    services.start_decode()
    wait_for_grpc_health(services.decode_port, timeout_s=120)
    # the worker serves: the gateway must see it within a poll or two, not after gRPC's reconnect backoff
    assert seconds_until_health(services.url, 200, timeout_s=MAX_SECONDS_TO_NOTICE) < MAX_SECONDS_TO_NOTICE
    after = generate(services.url)
    assert after.status_code == 200
    assert after.json()["text"] == before.json()["text"]   # same weights, greedy: the same answer
