"""The one gRPC-error table, `worker_error`: the body names the worker's role only (its address and
full answer go to the log), every 503 carries Retry-After, and `is_settled` tells a code the worker
answered from one the client side raised on its own."""

from __future__ import annotations

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
