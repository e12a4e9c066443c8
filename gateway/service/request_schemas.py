"""pydantic request schemas for the HTTP API (the only place pydantic is used)."""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidatorFunctionWrapHandler, field_validator


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text, as OpenAI sends it (an object is taken too)


class ToolCall(BaseModel):
    """A call an earlier assistant message made (sent back in the conversation)."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatRole(enum.StrEnum):
    """Who speaks in a chat message; the value is OpenAI's word."""

    SYSTEM = "system"
    DEVELOPER = "developer"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: ChatRole
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions (OpenAI plus SGLang's extras)."""

    model_config = ConfigDict(extra="allow")
    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # SGLang: keep the matched stop string / stop token's text
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    regex: str | None = None
    ebnf: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    priority: int | None = None  # lower is served first (vLLM's convention); gateway/caller.py


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    separate_reasoning: bool = True


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class NativeSamplingParams(BaseModel):
    """One entry of /generate's `sampling_params` (SGLang's names): an unknown key or a wrong type is a
    400 naming `sampling_params.<key>`. Strict, so JSON's types count as they are: `1` is not a flag
    and `"0.5"` not a number."""

    model_config = ConfigDict(extra="forbid", strict=True)
    n: int = 1
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    sampling_seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    json_schema: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    ebnf: str | None = None


class GenerateRequest(BaseModel):
    """SGLang's native /generate body."""

    model_config = ConfigDict(extra="forbid")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: str | list[str] | None = None
    # each of these four: one value for every prompt, or a list with one per prompt
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    priority: int | None = None  # lower is served first (vLLM's convention, not SGLang's default)
    # SGLang's LoRA choice: an adapter's name (None: the base model), or a list with one per prompt
    lora_path: str | list[str | None] | None = None

    @field_validator("sampling_params", mode="wrap")
    @classmethod
    def _sampling_params(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """One set for every prompt, or a list of one per prompt. Each set is validated alone, so that
        an error's param is `sampling_params.<key>` (pydantic would name the union member too)."""
        if isinstance(value, list):
            return [NativeSamplingParams.model_validate(params) for params in value]
        return NativeSamplingParams.model_validate(value)


class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings body; `user` is accepted and ignored."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EncodeRequest(BaseModel):
    """SGLang's native /encode body: `text` or `input_ids`, one input or a list. `model` is ignored, as in SGLang."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None
    model: str | None = None
    dimensions: int | None = None


class PoolingRequest(BaseModel):
    """vLLM's /pooling body: /v1/embeddings' inputs; `model` may be left out (the served one)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class ScoreRequest(BaseModel):
    """vLLM's /score body: `text_1` against `text_2`, each a text or a list (1 to 1, 1 to N, N to N)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    use_activation: bool | None = None  # False: a cross-encoder's raw logits instead of their sigmoid

    def firsts(self) -> list[str]:
        return [self.text_1] if isinstance(self.text_1, str) else self.text_1

    def seconds(self) -> list[str]:
        return [self.text_2] if isinstance(self.text_2, str) else self.text_2


class RerankDocumentText(BaseModel):
    """A document given as an object (Cohere's and Jina's form)."""

    text: str


class RerankRequest(BaseModel):
    """vLLM's /rerank body (Jina and Cohere style): `top_n` 0 keeps every document."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocumentText]
    top_n: int = 0
    return_documents: bool = True
    use_activation: bool | None = None  # as in ScoreRequest

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]
