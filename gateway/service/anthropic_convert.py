"""Anthropic's Messages request into the chat route's request, and the chat answer back into a Message.

The Messages API runs through the chat completion operation (gateway/service/chat.py): the system prompt
becomes a system message, an assistant turn's `tool_use` blocks its tool calls, a user turn's
`tool_result` blocks tool messages (before the turn's text, as Anthropic orders them), tools become
functions and `tool_choice` auto / any / tool / none becomes auto / required / a named function / none.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import APIError, bad_request
from gateway.records import FinishReason
from gateway.service.anthropic_schemas import (
    Message,
    MessageParam,
    MessagesRequest,
    MessageUsage,
    StopReason,
    TextBlock,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
    tool_use_id,
)
from gateway.service.request_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    ChatRole,
    StreamOptions,
    ToolCall,
    ToolCallFunction,
)
from gateway.service.response_schemas import ChatCompletion, ToolCallOut


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion that answers `body` (a count_tokens body renders the same prompt)."""
    tool_choice, parallel = _tool_choice(body)
    return ChatCompletionRequest(
        model=body.model,
        messages=_chat_messages(body),
        tools=[_function(t.name, t.description, t.input_schema) for t in body.tools] if body.tools else None,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        max_tokens=body.max_tokens,
        stop=body.stop_sequences,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stream=body.stream,
        stream_options=StreamOptions(include_usage=True) if body.stream else None,
        user=body.metadata.user_id if body.metadata else None,
        separate_reasoning=False,  # Messages has thinking blocks, not reasoning_content: the text stays whole
    )


def _chat_messages(body: MessagesRequest) -> list[ChatMessage]:
    system = body.system_text()
    messages = [ChatMessage(role=ChatRole.SYSTEM, content=system)] if system is not None else []
    for turn in body.messages:
        messages += _turn(turn)
    return messages


def _turn(turn: MessageParam) -> list[ChatMessage]:
    """One Messages turn as chat messages: a user turn's tool results first, then its text."""
    if isinstance(turn.content, str):
        return [ChatMessage(role=ChatRole(turn.role), content=turn.content)]
    text = "".join(block.text for block in turn.content if block.type == "text")
    calls = [block for block in turn.content if isinstance(block, ToolUseBlockParam)]
    results = [block for block in turn.content if isinstance(block, ToolResultBlockParam)]
    if turn.role == "assistant":
        if results:
            raise bad_request("an assistant message may not hold tool_result blocks", "messages")
        tool_calls = [
            ToolCall(id=c.id, function=ToolCallFunction(name=c.name, arguments=json.dumps(c.input, ensure_ascii=False)))
            for c in calls
        ]
        return [ChatMessage(role=ChatRole.ASSISTANT, content=text, tool_calls=tool_calls or None)]
    if calls:
        raise bad_request("a user message may not hold tool_use blocks", "messages")
    messages = [ChatMessage(role=ChatRole.TOOL, content=r.text(), tool_call_id=r.tool_use_id) for r in results]
    if text or not results:
        messages.append(ChatMessage(role=ChatRole.USER, content=text))
    return messages


def _function(name: str, description: str | None, input_schema: dict[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "parameters": input_schema}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def _tool_choice(body: MessagesRequest) -> tuple[Any, bool | None]:
    """`tool_choice` and `parallel_tool_calls` in the chat route's words."""
    choice = body.tool_choice
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request('tool_choice {"type": "tool"} needs the tool\'s name', "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def message(answer: ChatCompletion, model: str, message_id: str, stop_sequences: list[str] | None) -> Message:
    """The chat answer's only choice as a Message: its text, then its tool calls."""
    choice = answer.choices[0]
    content: list[TextBlock | ToolUseBlock] = []
    if choice.message.content:
        content.append(TextBlock(text=choice.message.content))
    content += [tool_use_block(call) for call in choice.message.tool_calls or ()]
    reason, sequence = stop_reason(choice.finish_reason, choice.matched_stop, stop_sequences)
    return Message(
        id=message_id,
        model=model,
        content=content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=MessageUsage(input_tokens=answer.usage.prompt_tokens, output_tokens=answer.usage.completion_tokens),
    )


def tool_use_block(call: ToolCallOut) -> ToolUseBlock:
    arguments = json.loads(call.function.arguments)  # the tool-call parser wrote it: always JSON
    return ToolUseBlock(
        id=tool_use_id(call.id),
        name=call.function.name,
        input=arguments if isinstance(arguments, dict) else {"arguments": arguments},
    )


def stop_reason(
    finish: str | None, matched: str | int | None, stop_sequences: list[str] | None
) -> tuple[StopReason, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat choice's finish_reason and matched_stop.
    An aborted generation is an error: Anthropic has no stop reason for it."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == FinishReason.LENGTH:
        return "max_tokens", None
    if finish == FinishReason.ABORT:
        raise APIError(503, "the generation was aborted by the server; try again", "server_overloaded")
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None
