"""The one gRPC-error table, `worker_error`: the body names the worker's role only (its address and
full answer go to the log), every 503 carries Retry-After, and `is_settled` tells a code the worker
answered from one the client side raised on its own."""

from __future__ import annotations

import asyncio
import contextvars
import logging

import grpc
import pytest

from gateway.cluster.worker_errors import WorkerError, worker_error
from gateway.errors import APIError
from gateway.records import Role
from tandem.request_log import bind_request_id

CONTEXT_MESSAGE = ("This model's maximum context length is 1024 tokens. However, your prompt has 2000 tokens, "
                   "leaving no room for a completion.")


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def test_names_the_role_only_and_logs_the_address(caplog) -> None:
    details = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:31002: Connection refused"
    with caplog.at_level(logging.INFO, logger="gateway.cluster.worker_errors"):
        error = worker_error(_rpc_error(grpc.StatusCode.UNAVAILABLE, details), Role.DECODE, "127.0.0.1:31002")
    assert isinstance(error, APIError) and isinstance(error, WorkerError)
    assert (error.status, error.code) == (503, "worker_unavailable")
    assert error.message == "the decode worker is unavailable"
    assert error.headers == {"Retry-After": "1"}   # every 503 from a worker says when to try again
    assert "decode worker 127.0.0.1:31002" in caplog.text and "Connection refused" in caplog.text
    assert error.detail == details and not error.is_settled   # the client side may have raised it


def test_points_at_the_request_id_when_one_is_bound() -> None:
    def inside_a_request() -> APIError:
        bind_request_id("req-42")
        return worker_error(_rpc_error(grpc.StatusCode.UNKNOWN, "Unexpected <class 'KeyError'>: 'x'"),
                            Role.PREFILL, "10.0.0.7:31001")
    error = contextvars.copy_context().run(inside_a_request)
    assert error.status == 500 and error.type == "internal_error" and error.headers is None
    assert error.message == "the prefill worker failed (request req-42; details in the gateway log)"


def test_keeps_the_workers_own_words_without_internals() -> None:
    context = worker_error(_rpc_error(grpc.StatusCode.OUT_OF_RANGE, CONTEXT_MESSAGE), Role.PREFILL, "127.0.0.1:1")
    assert (context.status, context.code, context.message) == (400, "context_length_exceeded", CONTEXT_MESSAGE)
    assert context.is_settled
    full = worker_error(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free pages on 127.0.0.1:31002"),
                        Role.DECODE, "127.0.0.1:31002")
    assert full.status == 503 and full.message == "the decode worker: no free pages on <address>"
    assert full.retry_after_s == 1 and full.code == "capacity_exceeded"
    bad = worker_error(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "cannot read /tmp/x/grammar.json"),
                       Role.PREFILL, "127.0.0.1:1")
    assert bad.status == 400 and bad.message == "cannot read <path>" and bad.retry_after_s is None


@pytest.mark.parametrize("code, status, message", [
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "the decode worker did not answer in time"),
    (grpc.StatusCode.CANCELLED, 503, "the call to the decode worker was cancelled"),
    (grpc.StatusCode.INTERNAL, 500, "the decode worker failed"),
    (grpc.StatusCode.UNIMPLEMENTED, 500, "the decode worker failed")])
def test_answers_a_fixed_line_where_grpc_or_an_exception_wrote_the_details(code, status, message) -> None:
    error = worker_error(_rpc_error(code, "Deadline on ipv4:127.0.0.1:31002 at /srv/x.py"), Role.DECODE, "x:1")
    assert (error.status, error.message) == (status, message)


@pytest.mark.parametrize("code, is_settled", [
    (grpc.StatusCode.DEADLINE_EXCEEDED, False), (grpc.StatusCode.CANCELLED, False),
    (grpc.StatusCode.UNAVAILABLE, False), (grpc.StatusCode.UNKNOWN, False),
    (grpc.StatusCode.INVALID_ARGUMENT, True), (grpc.StatusCode.PERMISSION_DENIED, True),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, True), (grpc.StatusCode.DATA_LOSS, True)])
def test_a_code_the_client_side_can_raise_leaves_the_call_unsettled(code, is_settled) -> None:
    assert worker_error(_rpc_error(code, "x"), Role.PREFILL, "x:1").is_settled is is_settled


def test_calls_that_reach_a_stopping_server_are_worker_failures() -> None:
    """A worker's gRPC server that stops (a drained worker, the moment its last request is done) cancels
    the calls that reach it meanwhile and refuses the later ones: both are the worker's failure, so a
    request that had no token yet goes to another worker."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    async def calls_around_a_stop() -> set[grpc.StatusCode]:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        codes: set[grpc.StatusCode] = set()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)

            async def check(delay_s: float) -> None:
                await asyncio.sleep(delay_s)
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    error = worker_error(exc, Role.DECODE, f"127.0.0.1:{port}")
                    assert error.is_worker_failure, exc.code()
                    codes.add(exc.code())

            calls = [asyncio.create_task(check(i * 0.0005)) for i in range(400)]
            await asyncio.sleep(0.05)
            await server.stop(grace=1)
            await asyncio.gather(*calls)
        return codes

    codes: set[grpc.StatusCode] = set()
    for _ in range(5):  # the race that cancels a call is narrow: a few stops make it near certain
        codes |= asyncio.run(calls_around_a_stop())
        if grpc.StatusCode.CANCELLED in codes:
            break
    assert grpc.StatusCode.UNAVAILABLE in codes and grpc.StatusCode.CANCELLED in codes
