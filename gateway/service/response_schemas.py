"""pydantic response models of the OpenAI routes (chat and text completions, their stream chunks, models)
and of SGLang's /generate: the JSON the clients read, keys in the order they are sent.

A field made with `omitted_if_none()` is left out of the JSON while it is None; every other field is
always sent, null included, as OpenAI's and SGLang's servers send them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from gateway.records import FinishReason
from gateway.service.request_schemas import ChatRole


def _is_none(value: Any) -> bool:
    return value is None


def omitted_if_none() -> Any:
    """A field that defaults to None and is left out of the JSON while None."""
    return Field(default=None, exclude_if=_is_none)


# OpenAI's finish_reason: the workers' reason, or "tool_calls" when the text held tool calls.
ChoiceFinish = FinishReason | Literal["tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token's text in UTF-8


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token (the echoed prompt's first
    token has no logprob and no top dict: None)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    """A tool call the model made; `index` only in stream deltas."""

    index: int | None = omitted_if_none()
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: ChatRole = ChatRole.ASSISTANT
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCallOut] | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChoiceFinish | None
    matched_stop: str | int | None  # the stop string or stop token id that ended it


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int  # Unix time
    model: str
    choices: list[ChatChoice]
    usage: Usage


class _MatchedStopAtTheEnd(BaseModel):
    """A stream choice: `matched_stop` is sent only beside its finish_reason, in a choice's last chunk."""

    @model_serializer(mode="wrap")
    def _drop_matched_stop_before_the_end(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data["finish_reason"] is None:
            del data["matched_stop"]
        return data


class ChatDelta(BaseModel):
    role: ChatRole | None = omitted_if_none()
    content: str | None = omitted_if_none()
    reasoning_content: str | None = omitted_if_none()
    tool_calls: list[ToolCallOut] | None = omitted_if_none()


class ChatStreamChoice(_MatchedStopAtTheEnd):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChoiceFinish | None = None
    matched_stop: str | int | None = None


class ChatCompletionChunk(BaseModel):
    """One chunk of a chat stream: one choice's delta, or (last, with include_usage) no choice and the usage."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = omitted_if_none()


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    matched_stop: str | int | None = None


class CompletionStreamChoice(CompletionChoice, _MatchedStopAtTheEnd):
    pass


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = omitted_if_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int  # Unix time the gateway started
    owned_by: str = "tandem"
    root: str
    max_model_len: int | None = omitted_if_none()  # once the workers have told the context length
    parent: str | None = omitted_if_none()  # a LoRA adapter's base model (its id)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# SGLang's /generate


class LengthFinish(BaseModel):
    type: Literal[FinishReason.LENGTH] = FinishReason.LENGTH
    length: int  # tokens generated


class StopFinish(BaseModel):
    type: Literal[FinishReason.STOP] = FinishReason.STOP
    matched: str | int | None  # the stop string or stop token id (None: an eos id)


class AbortFinish(BaseModel):
    type: Literal[FinishReason.ABORT] = FinishReason.ABORT
    message: str


class TandemTimings(BaseModel):
    """Per-phase milliseconds of one generation (see `HandoffTimings`); `first_token_ms` counts from the
    HTTP request's arrival. `prefill_path` says which worker prefilled the prompt: "disaggregated" (a
    prefill worker, the KV transferred) or "local" (the decode worker; reserve and KV transfer are 0).
    `decode_cached_tokens`: leading prompt tokens the decode worker already held in its prefix cache
    (not transferred; for a local prefill, the decode worker's cache hits)."""

    gateway_queue_ms: float
    reserve_ms: float
    prefill_queue_ms: float
    prefill_compute_ms: float
    kv_transfer_ms: float
    kv_bytes: int
    decode_queue_ms: float | None
    first_token_ms: float
    prefill_path: str
    decode_cached_tokens: int = 0


# [logprob, token id, token text]: the logprob is None at prompt position 0, the text None unless asked for.
LogprobTriple = tuple[float | None, int, str | None]


class NativeLogprobs(BaseModel):
    """/generate's logprob lists, when return_logprob is on. The input_* lists cover the prompt from
    logprob_start_len on; the top lists come with top_logprobs_num, the token-ids lists with
    token_ids_logprob. Position 0 of a prompt has no distribution: None in the top / token-ids lists."""

    input_token_logprobs: list[LogprobTriple] | None = omitted_if_none()
    output_token_logprobs: list[LogprobTriple] | None = omitted_if_none()
    input_top_logprobs: list[list[LogprobTriple] | None] | None = omitted_if_none()
    output_top_logprobs: list[list[LogprobTriple]] | None = omitted_if_none()
    input_token_ids_logprobs: list[list[LogprobTriple] | None] | None = omitted_if_none()
    output_token_ids_logprobs: list[list[LogprobTriple]] | None = omitted_if_none()


class _MetaInfoHead(BaseModel):
    id: str
    finish_reason: LengthFinish | StopFinish | AbortFinish | None  # None until the last event of a stream
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float  # seconds since the HTTP request arrived
    tandem_timings: TandemTimings | None = omitted_if_none()
    # speculative decoding (SGLang's name): the decode steps that verified draft tokens for this
    # request, and the drafts accepted; present once a step did (completion_tokens / spec_verify_ct
    # is the tokens per such step)
    spec_verify_ct: int | None = omitted_if_none()
    spec_accepted_tokens: int | None = omitted_if_none()


class MetaInfo(NativeLogprobs, _MetaInfoHead):
    """pydantic puts the fields of the last base first: the head's, then the logprob lists."""


class GenerateResponse(BaseModel):
    """One generation: `text`, or `token_ids` from a server without a tokenizer (as SGLang answers);
    `index` (its place among the request's generations) only in a stream of several."""

    text: str | None = omitted_if_none()
    token_ids: list[int] | None = omitted_if_none()
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = omitted_if_none()
