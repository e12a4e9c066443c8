"""The gRPC API's guards on one stack of three separate processes started with an API key, a 3 s
--request-timeout, no admission queue (--max-queued-requests 0), a 32-page KV pool and the NaN fault
hook on each worker: the key on every call but health's (checked before the body is read), the
request timeout capping a client's longer deadline, RESOURCE_EXHAUSTED, INTERNAL before and after a
stream's output began, and health Check and Watch (and UNAVAILABLE) following a killed decode worker."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.api.v1 import completion_pb2, inference_service_pb2
from tests.e2e.grpc_client import MODEL, Stub, call_error, chat_request, details_of, error_reason
from tests.e2e.stack import Services, running_services, wait_for
from tests.e2e.test_health import wait_for_grpc_health

pytestmark = pytest.mark.slow

KEY = f"grpc-{secrets.token_hex(8)}"
AUTH = (("authorization", f"Bearer {KEY}"),)
REQUEST_TIMEOUT_S = 3.0
PREFILL_NAN_SEED, DECODE_NAN_SEED = 4242, 1234  # TANDEM_FAULT_NAN_LOGITS_SEED of each worker
SERVICE = inference_service_pb2.DESCRIPTOR.services_by_name["InferenceService"]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def services(tmp_path_factory) -> Iterator[Services]:
    hook = "TANDEM_FAULT_NAN_LOGITS_SEED"
    with running_services(
        tmp_path_factory.mktemp("grpc_limits"),
        "--dtype",
        "float32",
        "--quantization",
        "none",
        "--max-total-tokens",
        "512",
        "--torch-threads",
        "1",
        gateway_flags=("--api-key", KEY, "--request-timeout", str(REQUEST_TIMEOUT_S), "--max-queued-requests", "0"),
        prefill_env={hook: str(PREFILL_NAN_SEED)},
        decode_env={hook: str(DECODE_NAN_SEED)},
    ) as services:
        yield services


@pytest.fixture(scope="module")
def channel(services: Services) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(services.grpc_target) as channel:
        yield channel


def _calls(channel: grpc.Channel) -> Iterator[tuple[str, object, object]]:
    """(name, the callable, an empty request) for every RPC of InferenceService."""
    for method in SERVICE.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        make = channel.unary_stream if method.server_streaming else channel.unary_unary
        call = make(
            f"/{SERVICE.full_name}/{method.name}",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        yield method.name, call, request_class()


def test_every_rpc_but_health_needs_the_key_before_its_body_is_read(channel: grpc.Channel) -> None:
    for name, call, request in _calls(channel):
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
            refused = call_error(call, request, timeout=10, metadata=metadata)
            assert refused.code() is grpc.StatusCode.UNAUTHENTICATED, (name, metadata, refused.code())
            assert refused.details() == "Incorrect API key provided." and KEY not in refused.details()
    # Not a protobuf message at all: without the key, it is refused unread; with it, parsed and refused.
    garbage = channel.unary_unary(f"/{SERVICE.full_name}/ChatComplete")
    assert call_error(garbage, b"\xff\xff\xff", timeout=10).code() is grpc.StatusCode.UNAUTHENTICATED
    assert call_error(garbage, b"\xff\xff\xff", timeout=10, metadata=AUTH).code() is not grpc.StatusCode.UNAUTHENTICATED
    # Reflection needs the key too; health does not.
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    assert call_error(reflection.ServerReflectionInfo, iter([ask]), timeout=10).code() is (
        grpc.StatusCode.UNAUTHENTICATED
    )
    (listed,) = reflection.ServerReflectionInfo(iter([ask]), timeout=10, metadata=AUTH)
    assert SERVICE.full_name in {s.name for s in listed.list_services_response.service}
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE.full_name):  # SERVING once /health answers 200 (the next 0.5 s poll)
        check = health_pb2.HealthCheckRequest(service=service)
        wait_for(lambda check=check: health.Check(check, timeout=10).status == SERVING, 10, f"{service!r} SERVING")
    answer = Stub(channel).ChatComplete(chat_request("Hi!", max_tokens=2), timeout=30, metadata=AUTH)
    assert answer.usage.completion_tokens == 2


def test_the_request_timeout_caps_a_longer_client_deadline(channel: grpc.Channel, services: Services) -> None:
    request = completion_pb2.CompletionRequest(
        model=MODEL, prompt=["Once upon a time"], max_tokens=400, ignore_eos=True, temperature=0
    )
    started = time.monotonic()
    chunks = []
    with pytest.raises(grpc.RpcError) as ended:
        for chunk in Stub(channel).CompleteStream(request, timeout=60, metadata=AUTH):
            chunks.append(chunk)
    assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    # Ended by the gateway's cap, far before the client's own 60 s deadline.
    assert REQUEST_TIMEOUT_S <= time.monotonic() - started < 30
    assert chunks and not any(c.choices[0].finish_reason for c in chunks if c.choices)
    services.assert_no_pages_held(within_s=10)


def test_a_full_decode_pool_with_no_queue_is_resource_exhausted(channel: grpc.Channel, services: Services) -> None:
    api = Stub(channel)
    holder = api.CompleteStream(
        completion_pb2.CompletionRequest(
            model=MODEL, prompt=["tell me more " * 100], max_tokens=150, ignore_eos=True, temperature=0
        ),
        timeout=30,
        metadata=AUTH,
    )
    next(holder)
    wait_for(lambda: services.load()["decode"].num_running == 1, 30, "the holder decoding")  # its pages reserved
    refused = call_error(
        api.Complete,
        completion_pb2.CompletionRequest(model=MODEL, prompt=["and then " * 120], max_tokens=4),
        timeout=30,
        metadata=AUTH,
    )
    holder.cancel()
    assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    assert error_reason(refused) == "QUEUE_FULL"
    assert details_of(refused)["RetryInfo"].retry_delay.seconds >= 1
    services.assert_no_pages_held(within_s=10)


def test_a_worker_failure_is_internal_before_and_after_the_output_began(
    channel: grpc.Channel, services: Services
) -> None:
    api = Stub(channel)
    at_prefill = call_error(
        api.Complete,
        completion_pb2.CompletionRequest(model=MODEL, prompt=["Tell me a story."], max_tokens=8, seed=PREFILL_NAN_SEED),
        timeout=30,
        metadata=AUTH,
    )
    assert at_prefill.code() is grpc.StatusCode.INTERNAL and "non-finite logits" in at_prefill.details()
    chunks = []
    with pytest.raises(grpc.RpcError) as at_decode:
        for chunk in api.ChatCompleteStream(
            chat_request("Tell me a story.", max_tokens=8, seed=DECODE_NAN_SEED), timeout=30, metadata=AUTH
        ):
            chunks.append(chunk)
    assert at_decode.value.code() is grpc.StatusCode.INTERNAL and "non-finite logits" in at_decode.value.details()
    assert any(c.choices[0].delta.content for c in chunks if c.choices)  # the first token came through
    assert not any(c.choices[0].finish_reason for c in chunks if c.choices)  # and no finish reason after it
    services.assert_no_pages_held(within_s=10)


def test_health_check_and_watch_follow_a_killed_and_restarted_decode_worker(
    channel: grpc.Channel, services: Services
) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    seen: list[int] = []
    watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE.full_name), timeout=300)

    def follow() -> None:
        try:
            for reply in watch:
                seen.append(reply.status)
        except grpc.RpcError:
            pass  # cancelled at the end

    follower = threading.Thread(target=follow)
    follower.start()
    try:
        wait_for(lambda: seen == [SERVING], 10, "Watch's first status")
        services.kill_decode()
        wait_for(lambda: NOT_SERVING in seen, 10, "Watch to report NOT_SERVING")
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == NOT_SERVING
        refused = call_error(Stub(channel).ChatComplete, chat_request("Hi!", max_tokens=2), timeout=30, metadata=AUTH)
        assert refused.code() is grpc.StatusCode.UNAVAILABLE and error_reason(refused) == "WORKER_UNAVAILABLE"
        assert details_of(refused)["RetryInfo"].retry_delay.seconds >= 1
        assert str(services.decode_port) not in refused.details()

        services.start_decode()
        wait_for_grpc_health(services.decode_port, timeout_s=120)
        wait_for(lambda: seen[-1] == SERVING, 10, "Watch to report SERVING again")
        assert seen == [SERVING, NOT_SERVING, SERVING]
        answer = Stub(channel).ChatComplete(chat_request("Hi!", max_tokens=2), timeout=30, metadata=AUTH)
        assert answer.usage.completion_tokens == 2
    finally:
        watch.cancel()
        follower.join(10)
