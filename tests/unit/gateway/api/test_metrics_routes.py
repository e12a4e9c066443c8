"""GatewayMetrics and MetricsMiddleware in-process: route templates and statuses, in-flight, handoff numbers."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from gateway.api.metrics_routes import MetricsMiddleware
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.records import HandoffTimings


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_middleware_counts_route_templates_statuses_and_in_flight() -> None:
    metrics = GatewayMetrics()
    app = FastAPI()
    seen_in_flight = []

    @app.get("/items/{item_id}")
    async def item(item_id: str) -> dict:
        seen_in_flight.append(value(metrics, "tandem_gateway_requests_in_flight"))
        return {"id": item_id}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("a bug")

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks():
            yield b"a"
            seen_in_flight.append(value(metrics, "tandem_gateway_requests_in_flight"))
            yield b"b"
        return StreamingResponse(chunks())

    app.add_middleware(MetricsMiddleware, metrics=metrics)
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/items/1").status_code == 200 and client.get("/items/2").status_code == 200
        assert client.get("/boom").status_code == 500
        assert client.get("/nowhere").status_code == 404
        assert client.get("/stream").text == "ab"
    requests = "tandem_gateway_requests_total"
    assert value(metrics, requests, route="/items/{item_id}", method="GET", status="200") == 2
    assert value(metrics, requests, route="/boom", method="GET", status="500") == 1
    assert value(metrics, requests, route="unmatched", method="GET", status="404") == 1
    assert value(metrics, requests, route="/stream", method="GET", status="200") == 1
    assert seen_in_flight == [1, 1, 1] and value(metrics, "tandem_gateway_requests_in_flight") == 0


def test_handoff_observations() -> None:
    metrics = GatewayMetrics()
    metrics.observe_first_token(HandoffTimings(reserve_ms=2, prefill_queue_ms=0, prefill_compute_ms=40,
                                               transfer_ms=8, kv_bytes=4096, first_token_ms=50, cached_tokens=16),
                                num_prompt_tokens=40)
    metrics.observe_tokens(3, 0.03)
    metrics.observe_tokens(0, 0.5)     # a finish-only message: no token, no latency
    metrics.observe_end("length", 0.2)
    metrics.observe_end("error", 0.1)
    assert value(metrics, "tandem_gateway_time_to_first_token_seconds_sum") == pytest.approx(0.05)
    assert value(metrics, "tandem_gateway_handoff_phase_seconds_sum", phase="prefill_compute") == pytest.approx(0.04)
    assert value(metrics, "tandem_gateway_kv_transfer_bytes_total") == 4096
    assert value(metrics, "tandem_gateway_prompt_tokens_total") == 40
    assert value(metrics, "tandem_gateway_cached_prompt_tokens_total") == 16
    assert value(metrics, "tandem_gateway_generation_tokens_total") == 4
    assert value(metrics, "tandem_gateway_inter_token_latency_seconds_count") == 3
    assert value(metrics, "tandem_gateway_inter_token_latency_seconds_sum") == pytest.approx(0.03)
    assert value(metrics, "tandem_gateway_generations_total", outcome="length") == 1
    assert value(metrics, "tandem_gateway_generations_total", outcome="error") == 1
    assert value(metrics, "tandem_gateway_e2e_request_latency_seconds_count") == 1   # errors have no e2e time


def test_metrics_route_needs_no_api_key(tmp_path) -> None:
    config = GatewayConfig(grpc_port=0, model_path="unused", served_model_name="m", prefill_addrs=("127.0.0.1:1",),
                           decode_addrs=("127.0.0.1:1",), api_key="sekret", skip_tokenizer_init=True,
                           data_dir=str(tmp_path))
    with TestClient(create_app(config)) as client:
        reply = client.get("/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    assert 'tandem_gateway_workers_ready{role="decode"} 0.0' in reply.text


def test_ready_workers_are_read_at_scrape_time() -> None:
    """The pool owns no metrics: the gauge asks it on every scrape, so it is never stale."""
    ready = {"prefill": 2, "decode": 0}
    metrics = GatewayMetrics()
    metrics.watch_pool(lambda role: ready[role])
    assert value(metrics, "tandem_gateway_workers_ready", role="prefill") == 2
    assert value(metrics, "tandem_gateway_workers_ready", role="decode") == 0
    ready["decode"] = 3
    assert value(metrics, "tandem_gateway_workers_ready", role="decode") == 3
