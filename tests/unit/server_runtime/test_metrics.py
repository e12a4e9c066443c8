"""WorkerMetrics: the RPC interceptor's status labels, the prefill counters and hit rate, the HTTP endpoint."""

from __future__ import annotations

import asyncio
import socket

import grpc
import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server_runtime.metrics import WorkerMetrics, serve_metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def value(metrics: WorkerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def _unary_ok(request: bytes, context) -> bytes:
    return request


async def _unary_aborts(request: bytes, context) -> bytes:
    await context.abort(grpc.StatusCode.NOT_FOUND, "no such request")


async def _unary_raises(request: bytes, context) -> bytes:
    raise RuntimeError("a bug")


async def _stream_ok(request: bytes, context):
    for _ in range(3):
        yield request


async def _stream_aborts(request: bytes, context):
    yield request
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")


async def _stream_forever(request: bytes, context):
    while True:
        yield request
        await asyncio.sleep(0.01)


def _handler(name: str) -> grpc.GenericRpcHandler:
    unary = {"UnaryOk": _unary_ok, "UnaryAborts": _unary_aborts, "UnaryRaises": _unary_raises}
    stream = {"StreamOk": _stream_ok, "StreamAborts": _stream_aborts, "StreamForever": _stream_forever}
    return grpc.method_handlers_generic_handler(name, {
        **{k: grpc.unary_unary_rpc_method_handler(v) for k, v in unary.items()},
        **{k: grpc.unary_stream_rpc_method_handler(v) for k, v in stream.items()}})


async def _exercise(metrics: WorkerMetrics) -> None:
    server = grpc.aio.server(interceptors=[metrics.interceptor()])
    server.add_generic_rpc_handlers((_handler("tandem.v1.Test"), _handler("other.Test")))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await channel.unary_unary("/tandem.v1.Test/UnaryOk")(b"x") == b"x"
            assert await channel.unary_unary("/other.Test/UnaryOk")(b"x") == b"x"   # not a tandem RPC
            for method in ("UnaryAborts", "UnaryRaises"):
                with pytest.raises(grpc.aio.AioRpcError):
                    await channel.unary_unary(f"/tandem.v1.Test/{method}")(b"x")
            assert [m async for m in channel.unary_stream("/tandem.v1.Test/StreamOk")(b"x")] == [b"x"] * 3
            with pytest.raises(grpc.aio.AioRpcError):
                _ = [m async for m in channel.unary_stream("/tandem.v1.Test/StreamAborts")(b"x")]
            forever = channel.unary_stream("/tandem.v1.Test/StreamForever")(b"x")
            await forever.read()
            forever.cancel()
            for _ in range(100):   # the server learns of the cancel a moment later
                if value(metrics, "tandem_worker_requests_total", method="StreamForever", code="CANCELLED"):
                    break
                await asyncio.sleep(0.02)
    finally:
        await server.stop(0)


def test_interceptor_counts_tandem_rpcs_by_method_and_final_status() -> None:
    metrics = WorkerMetrics("decode")
    asyncio.run(_exercise(metrics))
    counts = {(s.labels["method"], s.labels["code"]): s.value
              for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
              for s in family.samples if s.name == "tandem_worker_requests_total"}
    assert counts == {("UnaryOk", "OK"): 1, ("UnaryAborts", "NOT_FOUND"): 1, ("UnaryRaises", "UNKNOWN"): 1,
                      ("StreamOk", "OK"): 1, ("StreamAborts", "RESOURCE_EXHAUSTED"): 1,
                      ("StreamForever", "CANCELLED"): 1}


def test_record_prefill_accumulates_tokens_bytes_and_the_hit_rate() -> None:
    metrics = WorkerMetrics("prefill")
    metrics.record_prefill(100, 0, 4096, 0.002)
    metrics.record_prefill(100, 64, 4096, 0.004)
    assert value(metrics, "tandem_worker_prompt_tokens_total") == 200
    assert value(metrics, "tandem_worker_cached_prompt_tokens_total") == 64
    assert value(metrics, "tandem_worker_prefix_cache_hit_rate") == pytest.approx(0.32)
    assert value(metrics, "tandem_worker_kv_transfer_bytes_total") == 8192
    assert value(metrics, "tandem_worker_kv_transfer_seconds_count") == 2
    metrics.observe_step(0.01, num_outputs=3, num_tokens=2)
    assert value(metrics, "tandem_worker_step_seconds_count") == 1
    assert value(metrics, "tandem_worker_step_batch_size_sum") == 3
    assert value(metrics, "tandem_worker_generation_tokens_total") == 2


def test_serve_metrics_answers_prometheus_text_until_shut_down() -> None:
    metrics = WorkerMetrics("prefill", "/models/x", "1.0")
    port = free_port()
    server = serve_metrics(metrics.registry, "127.0.0.1", port)
    try:
        reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
        assert 'tandem_worker_info{model_path="/models/x",role="prefill",version="1.0"} 1.0' in reply.text
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
