"""Graceful drain of the decode worker (reliability.md scenario 18): on SIGTERM it answers NOT_SERVING
on its gRPC health service and refuses new reservations, the gateway stops routing to it (503 with
Retry-After), the streams in flight finish normally, and the process exits 0 once they have, well
before --drain-timeout. Started again, it serves the canary byte for byte. The gateway drains too:
it stops accepting connections at once, its gRPC API (tandem.api.v1) drains alongside HTTP (new calls
refused while the HTTP streams still run, its own stream finished), and it exits once all are done."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.api.v1 import completion_pb2
from tandem.v1 import decode_pb2, decode_pb2_grpc
from tests.chaos.checks import assert_nothing_leaked, assert_still_serving, canary
from tests.chaos.clients import Reply, completion
from tests.e2e.grpc_client import MODEL, Stub
from tests.e2e.stack import WORKER_METADATA, Services, running_services, wait_for, wait_health

pytestmark = [pytest.mark.slow, pytest.mark.chaos_extended]

DRAIN_TIMEOUT_S = 30
NUM_STREAMS = 3
MAX_TOKENS = 48
# The gateway test's streams must outlast the 5 s uvicorn gave them before --drain-timeout, yet end well
# within the gateway's own 30 s drain: about this long, at the rate a short burst of as many streams
# measures on this machine (500 tokens took 10 s on an AVX-512 EPYC and over 30 s on an AVX2 one).
GATEWAY_STREAM_S = 12.0


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    with running_services(
        tmp_path,
        "--dtype",
        "bfloat16",
        "--max-total-tokens",
        "4096",
        "--torch-threads",
        "1",
        "--drain-timeout",
        str(DRAIN_TIMEOUT_S),
    ) as services:
        yield services


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _reserve(port: int) -> grpc.StatusCode:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            decode_pb2_grpc.DecodeServiceStub(channel).Reserve(
                decode_pb2.ReserveRequest(request_id="late-comer", prompt_len=8), timeout=5, metadata=WORKER_METADATA
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_draining_decode_worker_finishes_its_streams_refuses_new_ones_and_exits_0(services: Services) -> None:
    baseline = canary(services.url)
    streams = [Reply() for _ in range(NUM_STREAMS)]
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = [
            pool.submit(completion, services.url, f"Tell me story number {i}.", MAX_TOKENS, True, reply)
            for i, reply in enumerate(streams)
        ]
        wait_for(lambda: all(len(s.events) >= 3 for s in streams), 120, "three tokens on every stream")
        services.decode.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()

        wait_for(lambda: _health(services.decode_port) == health_pb2.HealthCheckResponse.NOT_SERVING, 2, "NOT_SERVING")
        assert _reserve(services.decode_port) == grpc.StatusCode.UNAVAILABLE
        wait_health(services.url, 503, timeout_s=3)  # the gateway's next probe (every second) sees it
        refused = httpx.post(f"{services.url}/generate", json={"text": "Hello"}, timeout=30)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1, refused.text
        assert refused.json()["error"]["code"] == "worker_unavailable"
        seconds_to_refuse = time.monotonic() - signalled_at
        assert not all(s.is_done for s in streams), "the streams ended before the drain could be seen"
        for future in futures:
            future.result()

    assert services.decode.wait(DRAIN_TIMEOUT_S) == 0
    seconds_to_exit = time.monotonic() - signalled_at
    last_token_at = max(s.times[-1] for s in streams)
    print(
        f"SIGTERM -> NOT_SERVING, /health 503 and a new request refused: {seconds_to_refuse:.2f} s; "
        f"-> last stream done: {last_token_at - signalled_at:.2f} s; -> exit 0: {seconds_to_exit:.2f} s"
    )
    for stream in streams:
        assert stream.status == 200 and stream.lines[-1] == "data: [DONE]"
        assert not any("error" in e for e in stream.events), stream.lines[-3:]
        finishes = [c["finish_reason"] for e in stream.events for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"], stream.lines[-3:]
    assert seconds_to_exit < last_token_at - signalled_at + 3  # it exits once idle, not at the timeout

    services.start_decode()
    assert_still_serving(services.url, baseline, within_s=300)
    assert_nothing_leaked(services)


def _tokens_for(url: str, seconds: float, num_streams: int) -> int:
    """How many tokens `num_streams` streams at once each take about `seconds` to give here, from a burst of
    32-token streams (between 64 and 700, so that every stream fits the pool together)."""
    burst = [Reply() for _ in range(num_streams)]
    with ThreadPoolExecutor(num_streams) as pool:
        for future in [pool.submit(completion, url, f"Count to {i}.", 32, True, r) for i, r in enumerate(burst)]:
            future.result()
    seconds_per_token = max((r.times[-2] - r.times[0]) / 31 for r in burst)  # from the first token to the last
    return max(64, min(700, int(seconds / seconds_per_token)))


def test_a_draining_gateway_finishes_its_streams_and_takes_no_new_connection(services: Services) -> None:
    baseline = canary(services.url)
    max_tokens = _tokens_for(services.url, GATEWAY_STREAM_S, NUM_STREAMS + 1)
    streams = [Reply() for _ in range(NUM_STREAMS)]
    grpc_chunks: list[completion_pb2.CompletionChunk] = []
    with ThreadPoolExecutor(NUM_STREAMS + 1) as pool, grpc.insecure_channel(services.grpc_target) as channel:
        futures = [
            pool.submit(completion, services.url, f"Tell me story number {i}.", max_tokens, True, reply)
            for i, reply in enumerate(streams)
        ]
        grpc_stream = pool.submit(_grpc_stream, channel, max_tokens, grpc_chunks)
        wait_for(
            lambda: all(len(s.events) >= 3 for s in streams) and len(grpc_chunks) >= 3,
            120,
            "three tokens on every stream",
        )
        services.gateway.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        wait_for(lambda: _refuses_connections(services.url), 2, "the gateway to stop accepting connections")
        seconds_to_refuse = time.monotonic() - signalled_at
        # The gRPC API drains now too, not once HTTP's streams are done (they run for over 5 s more).
        wait_for(lambda: _grpc_refuses(services.grpc_target), 5, "the gRPC API to refuse new calls")
        assert not all(s.is_done for s in streams), "the streams ended before the drain could be seen"
        for future in futures:
            future.result()
        grpc_stream.result()
    finishes = [c.choices[0].finish_reason for c in grpc_chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] and grpc_chunks[-1].usage.completion_tokens == max_tokens

    # uvicorn re-raises the signal once it has shut down, so the process ends "killed by SIGTERM"
    assert services.gateway.wait(DRAIN_TIMEOUT_S) == -signal.SIGTERM
    seconds_to_exit = time.monotonic() - signalled_at
    last_token_at = max(s.times[-1] for s in streams)
    print(
        f"{max_tokens} tokens a stream; SIGTERM -> no new connection: {seconds_to_refuse:.2f} s; -> last stream done: "
        f"{last_token_at - signalled_at:.2f} s; -> exit: {seconds_to_exit:.2f} s"
    )
    assert last_token_at - signalled_at > 5, "the streams were too short to show a drain longer than 5 s"
    for stream in streams:
        assert stream.status == 200 and stream.lines[-1] == "data: [DONE]"
        finishes = [c["finish_reason"] for e in stream.events for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"], stream.lines[-3:]
    assert seconds_to_exit < last_token_at - signalled_at + 5  # it exits once idle, not at the timeout

    services.start_gateway("--data-dir", str(services.log_dir / "data"), timeout_s=120)
    assert_still_serving(services.url, baseline, within_s=120)
    assert_nothing_leaked(services)


def _grpc_stream(channel: grpc.Channel, max_tokens: int, chunks: list) -> None:
    request = completion_pb2.CompletionRequest(
        model=MODEL, prompt=["Tell me a story."], max_tokens=max_tokens, temperature=0, ignore_eos=True
    )
    request.stream_options.include_usage = True
    for chunk in Stub(channel).CompleteStream(request, timeout=120):
        chunks.append(chunk)


def _grpc_refuses(target: str) -> bool:
    """Whether the gateway's gRPC API refuses a new call (UNAVAILABLE) or reports NOT_SERVING, which comes
    first. Any other failure (a deadline missed on a busy machine) is not a refusal: the caller asks again."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError as exc:
            return exc.code() is grpc.StatusCode.UNAVAILABLE
    return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


def _refuses_connections(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.ConnectError:
        return True
    return False
