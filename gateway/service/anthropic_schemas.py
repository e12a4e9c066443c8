"""pydantic schemas of Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): the request
bodies, the answer, and the events of its stream. Unknown top-level fields are refused (400 naming
them) rather than ignored: a feature this gateway lacks (images, thinking) is never dropped silently."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class TextBlockParam(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: accepted, no effect here
    type: Literal["text"]
    text: str


class ToolUseBlockParam(BaseModel):
    """A tool call an earlier assistant turn made."""

    model_config = ConfigDict(extra="allow")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(BaseModel):
    """What a tool answered, sent back in a user turn."""

    model_config = ConfigDict(extra="allow")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


ContentBlockParam = Annotated[TextBlockParam | ToolUseBlockParam | ToolResultBlockParam, Field(discriminator="type")]


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class ToolParam(BaseModel):
    model_config = ConfigDict(extra="allow")  # type "custom", cache_control
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(BaseModel):
    user_id: str | None = None


class MessagesRequest(BaseModel):
    """/v1/messages' body."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "".join(block.text for block in self.system)
        return self.system


class CountTokensRequest(MessagesRequest):
    """/v1/messages/count_tokens' body: the same body, `max_tokens` optional. Only the model, system,
    messages and tools shape the prompt; the other fields are accepted and change nothing."""

    max_tokens: int | None = None  # type: ignore[assignment]


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str  # "toolu_..."
    name: str
    input: dict[str, Any]


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(BaseModel):
    """The answer of /v1/messages (and, with no content yet, the message of a stream's message_start)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJSONDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class MessageStart(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStart(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: TextBlock | ToolUseBlock


class Ping(BaseModel):
    type: Literal["ping"] = "ping"


class ContentBlockDelta(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJSONDelta


class ContentBlockStop(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDelta(BaseModel):
    """The message's end: why it stopped and the final usage (input tokens too, as the API now sends)."""

    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: MessageUsage


class MessageStop(BaseModel):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = (
    MessageStart | ContentBlockStart | Ping | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop
)


class TokenCount(BaseModel):
    input_tokens: int


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    """Anthropic's id for a call the tool-call parser named `call_...`."""
    return f"toolu_{call_id.removeprefix('call_')}"
