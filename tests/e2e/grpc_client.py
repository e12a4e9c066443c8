"""A client of the gateway's gRPC API (tandem.api.v1) for the e2e tests: the stubs generated from the
repo's protos, request builders, and readers of a failed call's status and google.rpc details."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from tandem.api.v1 import chat_pb2, inference_service_pb2_grpc
from tests.e2e.error_bodies import internal_details

MODEL = "SmolLM2-135M-Instruct"
Stub = inference_service_pb2_grpc.InferenceServiceStub


@contextlib.contextmanager
def inference_api(target: str) -> Iterator[Stub]:
    """An InferenceService stub on a fresh channel to `target` (host:port), closed on the way out."""
    with grpc.insecure_channel(target) as channel:
        yield Stub(channel)


def chat_request(content: str, **fields: Any) -> chat_pb2.ChatCompletionRequest:
    """One user message asking `content`, for MODEL, with `fields` set."""
    request = chat_pb2.ChatCompletionRequest(model=fields.pop("model", MODEL), **fields)
    request.messages.add(role="user", content=content)
    return request


def rich_status(error: grpc.RpcError) -> status_pb2.Status:
    """The google.rpc.Status a failed call carries in its trailers; checks that it agrees with the
    call's code and message and names no internal address, path or exception."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, (error.code(), error.details())
    assert status.code == error.code().value[0] and status.message == error.details()
    assert not internal_details(error.details()), error.details()
    return status


def details_of(error: grpc.RpcError) -> dict[str, Any]:
    """The status's details by kind: "ErrorInfo", "BadRequest", "RetryInfo" -> the unpacked message."""
    unpacked: dict[str, Any] = {}
    for detail in rich_status(error).details:
        for kind in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
            if detail.Is(kind.DESCRIPTOR):
                message = kind()
                detail.Unpack(message)
                unpacked[kind.DESCRIPTOR.name] = message
    return unpacked


def bad_fields(error: grpc.RpcError) -> list[str]:
    """The fields a failed call's google.rpc.BadRequest names."""
    bad = details_of(error).get("BadRequest")
    return [violation.field for violation in bad.field_violations] if bad else []


def error_reason(error: grpc.RpcError) -> str:
    """The ErrorInfo reason: the HTTP API's error code (or type), upper case."""
    return details_of(error)["ErrorInfo"].reason


def call_error(call: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    """The error a unary call, or a stream read to its end, fails with (AssertionError if it succeeds)."""
    try:
        reply = call(*args, **kwargs)
        if not hasattr(reply, "DESCRIPTOR"):
            list(reply)
    except grpc.RpcError as error:
        return error
    raise AssertionError("the call succeeded")
