"""gateway/service/response_schemas.py: which fields are sent as null and which are left out, in what order."""

from __future__ import annotations

import json

from gateway.records import FinishReason
from gateway.service.request_schemas import ChatRole
from gateway.service.response_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatStreamChoice,
    CompletionChunk,
    CompletionStreamChoice,
    FunctionCall,
    GenerateResponse,
    LengthFinish,
    MetaInfo,
    ModelCard,
    PromptTokensDetails,
    StopFinish,
    ToolCallOut,
    Usage,
)


def _json(model) -> dict:
    return json.loads(model.model_dump_json())


def test_a_chat_choice_sends_its_empty_fields_as_null() -> None:
    choice = ChatChoice(index=0, message=AssistantMessage(content="hi", reasoning_content=None, tool_calls=None),
                        logprobs=None, finish_reason=FinishReason.STOP, matched_stop=None)
    assert _json(choice) == {"index": 0, "message": {"role": "assistant", "content": "hi", "reasoning_content": None,
                                                     "tool_calls": None},
                             "logprobs": None, "finish_reason": "stop", "matched_stop": None}


def test_a_delta_holds_only_what_it_carries_and_matched_stop_comes_with_the_finish() -> None:
    def chunk(delta: ChatDelta, finish: FinishReason | None = None) -> dict:
        choice = ChatStreamChoice(index=1, delta=delta, finish_reason=finish, matched_stop=None)
        return _json(ChatCompletionChunk(id="c", created=7, model="m", choices=[choice]))["choices"][0]

    assert chunk(ChatDelta(role=ChatRole.ASSISTANT, content="")) == {
        "index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    assert chunk(ChatDelta(content="x")) == {"index": 1, "delta": {"content": "x"}, "logprobs": None,
                                             "finish_reason": None}
    assert chunk(ChatDelta(), FinishReason.LENGTH) == {"index": 1, "delta": {}, "logprobs": None,
                                                       "finish_reason": "length", "matched_stop": None}
    calls = [ToolCallOut(index=0, id="call_1", function=FunctionCall(name="f", arguments="{}"))]
    assert chunk(ChatDelta(tool_calls=calls))["delta"] == {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_usage_is_sent_only_in_the_last_chunk() -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=0))
    text = CompletionChunk(id="c", created=7, model="m",
                           choices=[CompletionStreamChoice(index=0, text="a", logprobs=None, finish_reason=None)])
    assert list(_json(text)) == ["id", "object", "created", "model", "choices"]
    assert _json(text)["choices"] == [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]
    last = _json(CompletionChunk(id="c", created=7, model="m", choices=[], usage=usage))
    assert list(last) == ["id", "object", "created", "model", "choices", "usage"] and last["choices"] == []


def test_a_model_card_names_its_context_once_known() -> None:
    card = ModelCard(id="m", created=1700000000, root="/models/m")
    assert _json(card) == {"id": "m", "object": "model", "created": 1700000000, "owned_by": "tandem",
                           "root": "/models/m"}
    assert _json(card.model_copy(update={"max_model_len": 1024}))["max_model_len"] == 1024


def test_generate_meta_info_keeps_sglangs_order_and_leaves_out_what_was_not_asked() -> None:
    meta = MetaInfo(id="r", finish_reason=LengthFinish(length=3), prompt_tokens=2, completion_tokens=3,
                    cached_tokens=0, e2e_latency=0.5, output_token_logprobs=[(-0.5, 7, None)],
                    input_token_logprobs=[(None, 1, "a")])
    answer = _json(GenerateResponse(text="abc", output_ids=[7, 8, 9], meta_info=meta))
    assert list(answer) == ["text", "output_ids", "meta_info"]
    assert list(answer["meta_info"]) == ["id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                                         "e2e_latency", "input_token_logprobs", "output_token_logprobs"]
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert answer["meta_info"]["input_token_logprobs"] == [[None, 1, "a"]]
    ids_only = _json(GenerateResponse(token_ids=[7], output_ids=[7], index=1,
                                      meta_info=meta.model_copy(update={"finish_reason": StopFinish(matched=None)})))
    assert list(ids_only) == ["token_ids", "output_ids", "meta_info", "index"]
    assert ids_only["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}
