"""Request priorities and tenants on the shared stack: a priority and a tenant header are taken on the
OpenAI routes (the Responses API's too), /generate and the gRPC API; a priority out of range or not an integer, and a bad tenant
header, are 400s (INVALID_ARGUMENT) naming the field. The ordering itself is unit-tested
(tests/unit/engine/test_scheduler_priority.py, tests/unit/gateway/cluster/test_admission.py) and
measured by benchmarks/priority.py."""

from __future__ import annotations

import grpc
import httpx
import pytest

from tandem.api.v1 import generate_pb2
from tandem.limits import MAX_PRIORITY
from tests.e2e.conftest import MODEL
from tests.e2e.grpc_client import bad_fields, call_error, chat_request, inference_api
from tests.e2e.stack import Stack

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": HI, "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 2, "store": False},
}


def _post(stack: Stack, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, headers=headers or {}, timeout=60)


def test_a_priority_and_a_tenant_are_served_on_every_route(stack: Stack) -> None:
    for path, body in BODIES.items():
        for priority, headers in ((-3, {"x-tandem-tenant": "team-a"}), (MAX_PRIORITY, {"authorization": "Bearer k"})):
            reply = _post(stack, path, {**body, "priority": priority}, headers)
            assert reply.status_code == 200, (path, reply.text)
    with inference_api(stack.grpc_target) as api:
        answer = api.ChatComplete(chat_request("hi", max_tokens=2, priority=5),
                                  metadata=(("x-llm-d-inference-fairness-id", "team-b"),))
        assert answer.choices[0].message.content


@pytest.mark.parametrize("priority", [MAX_PRIORITY + 1, -MAX_PRIORITY - 1, 1.5, "high"])
def test_a_bad_priority_is_a_400_naming_it(stack: Stack, priority) -> None:
    for path, body in BODIES.items():
        reply = _post(stack, path, {**body, "priority": priority})
        assert reply.status_code == 400, (path, reply.text)
        assert reply.json()["error"]["param"] == "priority", (path, reply.text)


def test_a_bad_tenant_header_is_a_400_naming_it(stack: Stack) -> None:
    body = BODIES["/v1/completions"]
    for headers, param in (({"x-tandem-tenant": "t" * 129}, "x-tandem-tenant"),
                           ({"x-tandem-tenant": "a", "x-llm-d-inference-fairness-id": "b"},
                            "x-llm-d-inference-fairness-id")):
        error = _post(stack, "/v1/completions", body, headers).json()["error"]
        assert error["param"] == param and error["code"] == "invalid_tenant", error


def test_the_grpc_api_refuses_a_bad_priority_and_tenant_naming_them(stack: Stack) -> None:
    with inference_api(stack.grpc_target) as api:
        error = call_error(api.Generate, generate_pb2.GenerateRequest(text=["hi"], priority=MAX_PRIORITY + 1))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and bad_fields(error) == ["priority"]
        error = call_error(api.ChatComplete, chat_request("hi", max_tokens=2),
                           metadata=(("x-tandem-tenant", "t" * 129),))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and bad_fields(error) == ["x-tandem-tenant"]
