"""The client API's messages to and from the HTTP routes' records, and its status table."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from gateway.errors import APIError, bad_request, context_length_exceeded
from gateway.grpc_api import requests
from gateway.grpc_api.convert import fill, to_values
from gateway.grpc_api.status import status_of
from gateway.service.request_schemas import ChatCompletionRequest, CompletionRequest, NativeSamplingParams
from gateway.service.response_schemas import ChatCompletion, CompletionLogprobs
from tandem.api.v1 import chat_pb2, completion_pb2, generate_pb2


def test_unset_fields_are_left_out_so_the_records_defaults_apply() -> None:
    message = chat_pb2.ChatCompletionRequest(model="m", temperature=0.0, n=0)
    message.messages.add(role="user", content="hi")
    values = requests.chat_values(message)
    assert values == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "n": 0}
    body = ChatCompletionRequest.model_validate(values)
    assert body.top_p is None and body.max_tokens is None and body.stream is False


def test_structs_keep_integers_and_unions_take_openais_shapes() -> None:
    message = chat_pb2.ChatCompletionRequest(model="m", seed=2**40)
    message.messages.add(role="user").content_parts.add(type="text", text="hi")
    message.tool_choice.function.name = "get_weather"
    message.response_format.type = "json_schema"
    message.response_format.json_schema.schema.update({"type": "string", "maxLength": 5})
    values = requests.chat_values(message)
    assert values["seed"] == 2**40
    assert values["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert values["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert values["response_format"]["json_schema"]["schema"] == {"type": "string", "maxLength": 5}
    assert isinstance(values["response_format"]["json_schema"]["schema"]["maxLength"], int)
    assert requests.chat_values(chat_pb2.ChatCompletionRequest(tool_choice=chat_pb2.ToolChoice(mode="none")))[
        "tool_choice"
    ] == "none"


def test_prompts_as_text_or_token_ids_but_not_both() -> None:
    message = completion_pb2.CompletionRequest(model="m")
    message.prompt_token_ids.add(ids=[1, 2, 3])
    assert CompletionRequest.model_validate(requests.completion_values(message)).prompt == [[1, 2, 3]]
    message.prompt.append("text")
    with pytest.raises(APIError) as refused:
        requests.completion_values(message)
    assert refused.value.param == "prompt"
    one = requests.generate_values(generate_pb2.GenerateRequest(text=["a"]), "r")
    two = requests.generate_values(generate_pb2.GenerateRequest(text=["a", "b"]), "r")
    assert (one["text"], one["rid"]) == ("a", "r") and (two["text"], two["rid"]) == (["a", "b"], ["r-0", "r-1"])


def test_lora_name_is_lora_path_for_generate_and_the_model_for_openais_requests() -> None:
    one = requests.generate_values(generate_pb2.GenerateRequest(text=["a", "b"], lora_name=["sql"]), "r")
    each = requests.generate_values(generate_pb2.GenerateRequest(text=["a", "b"], lora_name=["", "sql"]), "r")
    none = requests.generate_values(generate_pb2.GenerateRequest(text=["a"]), "r")
    assert (one["lora_path"], each["lora_path"], "lora_path" in none) == ("sql", [None, "sql"], False)
    completion = requests.completion_values(completion_pb2.CompletionRequest(model="m", prompt=["a"], lora_name="sql"))
    assert completion["model"] == "sql" and "lora_name" not in completion
    assert requests.completion_values(completion_pb2.CompletionRequest(model="m", prompt=["a"]))["model"] == "m"


def test_native_sampling_params_stay_strict() -> None:
    params = generate_pb2.SamplingParams(max_new_tokens=4, temperature=0.5, sampling_seed=7, stop=["x"])
    assert NativeSamplingParams.model_validate(to_values(params)).sampling_seed == 7
    with pytest.raises(APIError) as refused:
        requests.record(NativeSamplingParams, {"temperature": "hot"})
    assert refused.value.status == 400 and refused.value.param == "temperature"


def test_answers_fill_the_proto_with_unions_and_nulls_mapped() -> None:
    answer = ChatCompletion.model_validate(
        {
            "id": "c",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"content": "Paris", "reasoning_content": None, "tool_calls": None},
                    "logprobs": {"content": [{"token": "P", "logprob": -0.5, "bytes": [80], "top_logprobs": []}]},
                    "finish_reason": "stop",
                    "matched_stop": 2,
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                      "prompt_tokens_details": {"cached_tokens": 0}},
        }
    )
    message = fill(chat_pb2.ChatCompletionResponse(), answer.model_dump(mode="json"))
    choice = message.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "Paris", "stop")
    assert choice.WhichOneof("matched_stop") == "matched_stop_token_id" and choice.matched_stop_token_id == 2
    assert not choice.message.HasField("reasoning_content") and list(choice.logprobs.content[0].bytes) == [80]
    logprobs = CompletionLogprobs(tokens=["a", "b"], token_logprobs=[None, -1.0], top_logprobs=[None, {"b": -1.0}],
                                  text_offset=[0, 1])
    filled = fill(completion_pb2.CompletionLogprobs(), logprobs.model_dump(mode="json"))
    assert [entry.HasField("value") for entry in filled.token_logprobs] == [False, True]
    assert [dict(entry.logprobs) for entry in filled.top_logprobs] == [{}, {"b": -1.0}]
    meta = fill(generate_pb2.MetaInfo(), {"finish_reason": {"type": "stop", "matched": "\n"},
                                          "input_token_logprobs": [[None, 5, None], [-1.0, 6, "x"]]})
    assert meta.finish_reason.matched_text == "\n"
    first, second = meta.input_token_logprobs
    assert not first.HasField("logprob") and (second.logprob, second.token_id, second.token_text) == (-1.0, 6, "x")


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (bad_request("temperature must be between 0 and 2", "temperature"), grpc.StatusCode.INVALID_ARGUMENT),
        (context_length_exceeded(1024, 2000, 16, "messages"), grpc.StatusCode.OUT_OF_RANGE),
        (APIError(404, "no such model", param="model", code="model_not_found"), grpc.StatusCode.NOT_FOUND),
        (APIError(503, "overloaded", code="queue_full", retry_after_s=1), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (APIError(503, "no prefill worker is ready", code="worker_unavailable"), grpc.StatusCode.UNAVAILABLE),
        (APIError(502, "the decode worker failed"), grpc.StatusCode.INTERNAL),
        (APIError(499, "aborted", code="aborted_by_id"), grpc.StatusCode.CANCELLED),
    ],
)
def test_each_error_has_its_status_and_a_field_violation_where_it_names_one(error: APIError, code) -> None:
    status = status_of(error)
    assert status.code is code
    (key, raw), = status.trailing_metadata
    assert key == "grpc-status-details-bin"
    rich = status_pb2.Status.FromString(raw)
    kinds = {detail.type_url.rsplit(".", 1)[-1] for detail in rich.details}
    assert ("BadRequest" in kinds) == (code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE))
    assert ("RetryInfo" in kinds) == (error.retry_after_s is not None)
    for detail in rich.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            assert bad.field_violations[0].field == error.param


def test_error_info_names_the_http_code_or_type_and_status() -> None:
    for error, reason in ((bad_request("bad", "temperature"), "INVALID_REQUEST_ERROR"),
                          (context_length_exceeded(1024, 2000, 16), "CONTEXT_LENGTH_EXCEEDED"),
                          (APIError(503, "busy", "server_overloaded", code="queue_full"), "QUEUE_FULL")):
        (_, raw), = status_of(error).trailing_metadata
        (info,) = [d for d in status_pb2.Status.FromString(raw).details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
        unpacked = error_details_pb2.ErrorInfo()
        info.Unpack(unpacked)
        assert (unpacked.reason, unpacked.domain) == (reason, "tandem.api.v1")
        assert unpacked.metadata["http_status"] == str(error.status)
