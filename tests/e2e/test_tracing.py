"""`--otlp-traces-endpoint`: a `tandem serve` stack exports one trace per request to the in-process
OTLP receiver, in the caller's trace (its `traceparent`), as one tree across the gateway's and the
workers' processes, joined by the traceparent the gateway's gRPC calls carry. (With no endpoint
nothing is set up: tests/unit/tandem/test_tracing.py.)"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest

from tandem.api.v1 import generate_pb2
from tests.e2e.conftest import MODEL
from tests.e2e.grpc_client import inference_api
from tests.e2e.stack import Stack, start_stack
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, format_tree

pytestmark = pytest.mark.slow

PROMPT = "What is the capital of France?"
# The phases of a disaggregated request, below the front's span: (name, the parent's name, its process).
DISAGGREGATED = (
    ("tokenize", "front", "tandem-gateway"),
    ("gateway_queue", "front", "tandem-gateway"),
    ("first_token", "front", "tandem-gateway"),
    ("route", "first_token", "tandem-gateway"),
    ("reserve", "first_token", "tandem-gateway"),
    ("prefill", "first_token", "tandem-gateway"),  # the Prefill call, whose traceparent the worker joins
    ("prefill", "prefill", "tandem-prefill"),
    ("prefill_queue", "prefill", "tandem-prefill"),
    ("prefill_compute", "prefill", "tandem-prefill"),
    ("kv_transfer", "prefill", "tandem-prefill"),
    ("finish", "front", "tandem-gateway"),
    ("decode", "finish", "tandem-decode"),  # the Generate call's worker side
    ("decode_queue", "decode", "tandem-decode"),
)
# Prompts this short are prefilled by their decode worker (no reservation, no KV transfer).
LOCAL_PREFILL_THRESHOLD = 8


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def traced_stack(tmp_path_factory, receiver: OtlpReceiver) -> Iterator[Stack]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the SDK's batch interval (default 5 s): spans sooner
        stack = start_stack(
            tmp_path_factory.mktemp("traced"),
            "--otlp-traces-endpoint", receiver.endpoint,
            "--local-prefill-threshold", str(LOCAL_PREFILL_THRESHOLD),
            "--max-total-tokens", "4096", "--context-length", "1024", "--torch-threads", "1",
        )
    yield stack
    stack.stop()
    assert stack.proc.returncode == 0


def _traceparent() -> tuple[str, str, str]:
    """A caller's traceparent header (sampled), with its trace id and span id."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _check_tree(spans: list[ReceivedSpan], caller_span_id: str, front_name: str, phases) -> None:
    """One tree: the front's span under the caller's, every other span under one of the trace's, and
    each phase under the parent (and in the process) `phases` names."""
    by_id = {s.span_id: s for s in spans}
    [front] = [s for s in spans if s.parent_span_id == caller_span_id]
    assert (front.name, front.service) == (front_name, "tandem-gateway")
    assert all(s.parent_span_id in by_id for s in spans if s is not front), format_tree(spans)
    found = set()
    for s in spans:
        if s is front:
            continue
        parent = by_id[s.parent_span_id]
        found.add((s.name, "front" if parent is front else parent.name, s.service))
    assert found == set(phases), format_tree(spans)
    assert not any(s.is_error for s in spans), format_tree(spans)
    assert all(s.start_ns <= s.end_ns for s in spans)


def test_a_chat_request_is_one_trace_across_the_three_processes(traced_stack: Stack, receiver: OtlpReceiver) -> None:
    traceparent, trace_id, caller_span_id = _traceparent()
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0}
    reply = httpx.post(
        f"{traced_stack.url}/v1/chat/completions", json=body, headers={"traceparent": traceparent}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    spans = receiver.wait_for(trace_id, {name for name, _, _ in DISAGGREGATED} | {"POST /v1/chat/completions"})
    print("\n" + format_tree(spans, ("tandem.finish_reason", "tandem.prompt_tokens", "tandem.kv_bytes")))
    _check_tree(spans, caller_span_id, "POST /v1/chat/completions", DISAGGREGATED)
    [finish] = [s for s in spans if s.name == "finish"]
    assert finish.attributes["tandem.finish_reason"] == reply.json()["choices"][0]["finish_reason"]
    assert finish.attributes["tandem.output_tokens"] == reply.json()["usage"]["completion_tokens"]
    # The prompt's text is in no span; its token count is.
    assert not any("France" in str(value) for s in spans for value in s.attributes.values())
    [tokenize] = [s for s in spans if s.name == "tokenize"]
    assert tokenize.attributes["tandem.prompt_tokens"] == reply.json()["usage"]["prompt_tokens"]


def test_a_grpc_stream_with_a_traceparent_and_a_local_prefill(traced_stack: Stack, receiver: OtlpReceiver) -> None:
    """The gRPC API's span joins the caller's traceparent metadata; a prompt under the local-prefill
    threshold is prefilled by the decode worker, whose prefill spans hang from `first_token`."""
    traceparent, trace_id, caller_span_id = _traceparent()
    with inference_api(traced_stack.grpc_target) as api:
        chunks = list(api.GenerateStream(_short_generate(), metadata=(("traceparent", traceparent),), timeout=120))
    assert chunks
    local = (
        ("gateway_queue", "front", "tandem-gateway"),
        ("first_token", "front", "tandem-gateway"),
        ("route", "first_token", "tandem-gateway"),
        ("prefill", "first_token", "tandem-decode"),
        ("prefill_queue", "prefill", "tandem-decode"),
        ("prefill_compute", "prefill", "tandem-decode"),
        ("finish", "front", "tandem-gateway"),
    )
    front = "tandem.api.v1.InferenceService/GenerateStream"
    spans = receiver.wait_for(trace_id, {name for name, _, _ in local} | {front})
    _check_tree(spans, caller_span_id, front, local)
    [route] = [s for s in spans if s.name == "route"]
    assert route.attributes["tandem.prefill_path"] == "local"


def test_a_request_without_a_traceparent_starts_its_own_trace(traced_stack: Stack, receiver: OtlpReceiver) -> None:
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
    reply = httpx.post(f"{traced_stack.url}/generate", json=body, timeout=120)
    assert reply.status_code == 200
    root = receiver.wait_for_span("POST /generate")
    assert root.parent_span_id == ""
    spans = receiver.wait_for(root.trace_id, {"tokenize", "first_token", "finish"})
    assert {s.service for s in spans} >= {"tandem-gateway"}


def _short_generate() -> generate_pb2.GenerateRequest:
    """Three prompt tokens (under LOCAL_PREFILL_THRESHOLD), two new ones."""
    request = generate_pb2.GenerateRequest()
    request.input_ids.add(ids=[1, 2, 3])
    request.sampling_params.max_new_tokens = 2
    return request
