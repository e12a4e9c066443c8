"""`tandem.tracing`: spans exported over real OTLP/gRPC to the in-process receiver, the caller's
traceparent joined and passed on in gRPC metadata; with no endpoint, nothing set up and nothing sent
(even with the OTEL_* variables pointing at a collector). Each case runs in its own process, since
OpenTelemetry's tracer provider is set once per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.tracing import check_endpoint
from tests.otlp_receiver import OtlpReceiver, format_tree

ROOT = Path(__file__).resolve().parents[3]
CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"

def _run(endpoint: str | None, env: dict[str, str]) -> str:
    """One "request" as the gateway and a worker make it, in a process of its own (which flushes its
    spans as it exits): the front's span joined to the caller's traceparent, a phase current while it
    runs, one recorded afterwards from perf_counter times, and a worker's span under the metadata
    the call carries. Prints whether tracing is on, the traceparent sent on, whether a span was made."""
    code = f"""
import time
from tandem import tracing

with tracing.tracing_to({endpoint!r}, "unit-test"):
    caller = tracing.from_headers([("traceparent", "{TRACEPARENT}")])
    root = tracing.start_root_span("POST /v1/chat/completions", caller) if tracing.is_on() else None
    request = tracing.context_of(root, caller)
    with tracing.attached(request):
        with tracing.span("tokenize"):
            time.sleep(0.001)
        arrived = time.perf_counter()
        time.sleep(0.002)
        queue = tracing.record_span("gateway_queue", tracing.current(), arrived, time.perf_counter())
        metadata = tracing.to_metadata(tracing.current())
    worker = tracing.caller_context(metadata)
    tracing.record_span("prefill", worker, arrived, time.perf_counter(), tracing.SpanKind.SERVER)
    tracing.end_span(root)
    print("on" if tracing.is_on() else "off", dict(metadata).get("traceparent", "-"), queue is not None)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": f"{ROOT}/protos:{ROOT}", **env},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


def test_spans_reach_the_collector_in_the_callers_trace_as_one_tree(receiver: OtlpReceiver) -> None:
    state, traceparent, recorded = _run(receiver.endpoint, {}).split()
    assert (state, recorded) == ("on", "True")
    assert traceparent.split("-")[1] == CALLER_TRACE_ID  # the worker's call carries the caller's trace on
    spans = receiver.wait_for(CALLER_TRACE_ID, {"POST /v1/chat/completions", "tokenize", "gateway_queue", "prefill"})
    by_name = {s.name: s for s in spans}
    root = by_name["POST /v1/chat/completions"]
    assert root.parent_span_id == CALLER_SPAN_ID and root.service == "unit-test"
    assert by_name["tokenize"].parent_span_id == root.span_id
    assert by_name["gateway_queue"].parent_span_id == root.span_id
    assert by_name["prefill"].parent_span_id == root.span_id  # through the metadata, as a worker joins
    assert all(s.start_ns <= s.end_ns for s in spans)
    assert "    tokenize" in format_tree(spans)


def test_no_endpoint_sets_up_nothing_and_sends_nothing(receiver: OtlpReceiver) -> None:
    # The SDK's own variables name a collector: still nothing, since no exporter is ever made.
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint}
    assert _run(None, env) == "off - False"
    assert receiver.spans() == []  # the process has exited: whatever it would have sent was sent


@pytest.mark.parametrize("endpoint", ["localhost:4317", "4317", "ftp://host:4317", "http://"])
def test_an_endpoint_must_be_a_collector_url(endpoint: str) -> None:
    with pytest.raises(ValueError, match="otlp_traces_endpoint must be a URL"):
        check_endpoint(endpoint)


def test_collector_urls_are_accepted() -> None:
    for endpoint in (None, "http://127.0.0.1:4317", "https://collector.example:4317", "grpc://jaeger:4317"):
        check_endpoint(endpoint)
