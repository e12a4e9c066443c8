"""The gRPC API's errors and the end of a call, on the shared stack: a bad request is a status naming
its field (never OK), an over-long prompt is refused before a worker is asked, and a stream cancelled
by its client, past its deadline or aborted by id from another call frees its pages on both workers."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.api.v1 import completion_pb2, generate_pb2, inference_service_pb2
from tests.e2e.grpc_client import MODEL, Stub, bad_fields, call_error, chat_request, error_reason, inference_api
from tests.e2e.stack import Stack, wait_for

pytestmark = pytest.mark.slow

# A stream far longer than any test waits for (tens of seconds of decoding on this CPU).
LONG = {"max_tokens": 600, "ignore_eos": True, "temperature": 0}
FREED_WITHIN_S = 10.0  # room for a busy machine; a stream left running (LONG) would hold its pages far longer


@pytest.fixture(scope="module")
def api(stack: Stack):
    with inference_api(stack.grpc_target) as api:
        yield api


def _pages_held(stack: Stack) -> dict[str, int]:
    return {
        role: load.num_total_pages - load.num_free_pages - load.num_cached_pages for role, load in stack.load().items()
    }


def _rpcs_answered(stack: Stack) -> dict[str, float]:
    """How many Reserve (decode) and Prefill (prefill) calls each worker has answered."""
    counts = {}
    for role, method in (("decode", "Reserve"), ("prefill", "Prefill")):
        counts[role] = sum(
            float(line.split()[-1])
            for line in stack.worker_metrics(role).splitlines()
            if line.startswith("tandem_worker_requests_total") and f'method="{method}"' in line
        )
    return counts


def _seen_prefilling(stack: Stack, call: grpc.Future, timeout_s: float = 30) -> bool:
    """Whether the prefill worker runs or queues a request before `call` completes (False when it completed
    first); AssertionError with the call's error when it failed, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = stack.load()["prefill"]
        if load.num_running + load.num_waiting > 0:
            return True
        if call.done():
            if call.exception() is not None:
                raise AssertionError(f"the call failed before it was seen prefilling: {call.exception()}")
            return False
        time.sleep(0.05)
    raise AssertionError(f"waited {timeout_s:g} s for the prompt prefilling")


def test_bad_requests_are_invalid_argument_naming_the_field(api) -> None:
    hot = call_error(api.ChatComplete, chat_request("hi", temperature=5.0), timeout=30)
    assert hot.code() is grpc.StatusCode.INVALID_ARGUMENT and bad_fields(hot) == ["temperature"]
    assert "temperature" in hot.details() and error_reason(hot) == "INVALID_REQUEST_ERROR"
    streamed = call_error(api.ChatCompleteStream, chat_request("hi", top_logprobs=3), timeout=30)
    assert streamed.code() is grpc.StatusCode.INVALID_ARGUMENT and bad_fields(streamed) == ["top_logprobs"]
    both = chat_request("hi")
    both.messages[0].content_parts.add(type="text", text="hi")
    refused = call_error(api.ChatComplete, both, timeout=30)
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT and bad_fields(refused) == ["messages.content_parts"]
    no_role = call_error(api.ChatComplete, chat_request("hi", messages=[{"role": "wizard", "content": "x"}]))
    assert no_role.code() is grpc.StatusCode.INVALID_ARGUMENT and bad_fields(no_role)[0].startswith("messages.")
    regex = call_error(api.Complete, completion_pb2.CompletionRequest(model=MODEL, prompt=["x"], regex="(a|"))
    assert regex.code() is grpc.StatusCode.INVALID_ARGUMENT and "invalid regex" in regex.details()
    ids = generate_pb2.GenerateRequest(text=["x"], return_logprob=True, logprob_start_len=5)
    ids.input_ids.add(ids=[1, 2])
    assert bad_fields(call_error(api.Generate, ids, timeout=30)) == ["text"]
    no_prompt = call_error(api.Generate, generate_pb2.GenerateRequest(), timeout=30)
    assert no_prompt.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_an_unknown_model_is_not_found_and_a_long_prompt_out_of_range_before_any_worker(api, stack: Stack) -> None:
    unknown = call_error(api.ChatComplete, chat_request("hi", model="gpt-4"), timeout=30)
    assert unknown.code() is grpc.StatusCode.NOT_FOUND and error_reason(unknown) == "MODEL_NOT_FOUND"
    assert "gpt-4" in unknown.details()
    before = _rpcs_answered(stack)
    long_prompt = "word " * 1500  # over the stack's 1024-token context
    over = call_error(api.ChatCompleteStream, chat_request(long_prompt, max_tokens=8), timeout=30)
    assert over.code() is grpc.StatusCode.OUT_OF_RANGE and bad_fields(over) == ["messages"]
    assert "maximum context length is 1024 tokens" in over.details()
    assert error_reason(over) == "CONTEXT_LENGTH_EXCEEDED"
    native = call_error(api.Generate, generate_pb2.GenerateRequest(text=[long_prompt]), timeout=30)
    assert native.code() is grpc.StatusCode.OUT_OF_RANGE
    assert _rpcs_answered(stack) == before  # no worker was asked for pages or a prefill


def test_a_cancelled_stream_frees_its_pages_on_both_workers_at_once(api, stack: Stack) -> None:
    stream = api.ChatCompleteStream(chat_request("Write a long story about the sea.", **LONG), timeout=120)
    received = [next(stream) for _ in range(4)]  # the role, then content
    assert received[-1].choices[0].delta.content
    assert _pages_held(stack)["decode"] > 0
    stream.cancel()
    with pytest.raises(grpc.RpcError) as ended:
        list(stream)
    assert ended.value.code() is grpc.StatusCode.CANCELLED
    stack.assert_no_pages_held(within_s=FREED_WITHIN_S)
    loads = stack.load()
    assert all(load.num_running == 0 and load.num_waiting == 0 for load in loads.values()), loads


def test_a_dropped_connection_and_a_cancelled_unary_call_free_their_pages_too(api, stack: Stack) -> None:
    with grpc.insecure_channel(stack.grpc_target) as channel:  # a client that goes away mid-stream
        stream = Stub(channel).ChatCompleteStream(chat_request("Write a long story about a cat.", **LONG), timeout=120)
        next(stream), next(stream)
        assert _pages_held(stack)["decode"] > 0
    stack.assert_no_pages_held(within_s=FREED_WITHIN_S)

    unary = api.Complete.future(
        completion_pb2.CompletionRequest(model=MODEL, prompt=["Once upon a time"], **LONG), timeout=120
    )
    wait_for(lambda: _pages_held(stack)["decode"] > 0, 30, "the unary call decoding")
    assert unary.cancel()
    stack.assert_no_pages_held(within_s=FREED_WITHIN_S)

    # Cancelled while its long prompt is still prefilling (chunks of 512 tokens, seconds each here). A call
    # that completes before it is seen there is sent again with another prompt (no prefix in the cache).
    for attempt in range(3):
        prompt = f"{attempt}: " + "a river and a mountain " * 180
        prefilling = api.Complete.future(
            completion_pb2.CompletionRequest(model=MODEL, prompt=[prompt], max_tokens=4), timeout=120
        )
        if _seen_prefilling(stack, prefilling) and prefilling.cancel():
            break
    else:
        raise AssertionError("three long prompts each completed before the prefill worker was seen with them")
    stack.assert_no_pages_held(within_s=10)
    loads = stack.load()
    assert all(load.num_running == 0 and load.num_waiting == 0 for load in loads.values()), loads


def test_a_deadline_that_expires_mid_stream_ends_it_and_frees_its_pages(api, stack: Stack) -> None:
    request = completion_pb2.CompletionRequest(model=MODEL, prompt=["Once upon a time"], **LONG)
    chunks = []
    with pytest.raises(grpc.RpcError) as ended:
        for chunk in api.CompleteStream(request, timeout=3.0):
            chunks.append(chunk)
    assert ended.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(chunks) > 1 and not any(c.choices[0].finish_reason for c in chunks if c.choices)
    stack.assert_no_pages_held(within_s=FREED_WITHIN_S)


def test_abort_by_id_from_another_call_ends_the_stream_with_cancelled(api, stack: Stack) -> None:
    request = generate_pb2.GenerateRequest(
        text=["Tell me about rivers."],
        rid="grpc-abort-me",
        sampling_params=generate_pb2.SamplingParams(max_new_tokens=600, ignore_eos=True, temperature=0),
    )
    first = threading.Event()
    outputs = []

    def consume() -> grpc.RpcError | None:
        try:
            for output in api.GenerateStream(request, timeout=120):
                outputs.append(output)
                first.set()
        except grpc.RpcError as error:
            return error
        return None

    with ThreadPoolExecutor(1) as pool:
        ended = pool.submit(consume)
        assert first.wait(60)
        # Another call may not take an id in flight.
        duplicate = call_error(api.Generate, request, timeout=30)
        assert duplicate.code() is grpc.StatusCode.ALREADY_EXISTS and bad_fields(duplicate) == []
        abort = api.Abort(inference_service_pb2.AbortRequest(request_id="grpc-abort-me"), timeout=10)
        assert abort.found
        error = ended.result(timeout=30)
    assert error is not None and error.code() is grpc.StatusCode.CANCELLED and "aborted" in error.details()
    assert outputs[0].meta_info.id == "grpc-abort-me" and not outputs[-1].meta_info.finish_reason.type
    stack.assert_no_pages_held(within_s=FREED_WITHIN_S)
    assert not api.Abort(inference_service_pb2.AbortRequest(request_id="grpc-abort-me"), timeout=10).found
    # The id is free again once its call has ended.
    request.sampling_params.max_new_tokens = 2
    (output,) = api.Generate(request, timeout=60).outputs
    assert output.meta_info.id == "grpc-abort-me" and output.meta_info.completion_tokens == 2
