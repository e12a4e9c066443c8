"""pydantic models of OpenAI's Responses API (/v1/responses): the request body, the items of input
and output, the response object and the stream's events, in the shapes of the openai SDK's
`openai.types.responses` (function tools only; text, messages and function calls)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from gateway.service.response_schemas import omitted_if_none

ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class TextContent(BaseModel):
    """A message's text: `input_text` in the caller's messages, `output_text` (with its empty
    `annotations` and `logprobs`) in the model's."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = omitted_if_none()
    logprobs: list[Any] | None = omitted_if_none()


def output_text(text: str) -> TextContent:
    return TextContent(type="output_text", text=text, annotations=[], logprobs=[])


class MessageItem(BaseModel):
    """A message; the caller's `type` may be left out, and its content may be plain text."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str
    status: ItemStatus | None = None


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output") else "unknown"


# An input or output item, told apart by `type` ("message" when left out); another type is a 400.
Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_kind,
        custom_error_type="item_type",
        custom_error_message="an item's type must be message, function_call or function_call_output",
    ),
]


_ITEMS = TypeAdapter(list[Item])


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON following `schema` (structured output)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = omitted_if_none()
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", exclude_if=lambda v: v is None)
    description: str | None = omitted_if_none()
    strict: bool | None = omitted_if_none()


class TextConfig(BaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


class CreateResponseRequest(BaseModel):
    """The body of POST /v1/responses; fields OpenAI has and this gateway does not use are accepted."""

    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[Item]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    priority: int | None = None  # vLLM's extension: lower is served first (gateway/caller.py)

    @field_validator("input", mode="wrap")
    @classmethod
    def _input(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """Text, or a list validated as items alone, so that an error names `input.<index>...`
        (pydantic would name the union member too)."""
        return value if isinstance(value, str) else _ITEMS.validate_python(value)


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The response object: create's answer (or a stream's snapshots), retrieve's, cancel's."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    background: bool
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[Item] = Field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    text: TextConfig
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice
    tools: list[FunctionTool]
    usage: ResponseUsage | None = None
    metadata: dict[str, str]
    user: str | None = None


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
