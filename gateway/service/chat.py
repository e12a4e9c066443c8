"""OpenAI's chat completion, for every front (the HTTP route and the gRPC API): the prompt through the
chat template (tools included), the generations, the answer or its chunks."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from gateway.errors import bad_request
from gateway.service.choice_requests import choice_requests
from gateway.service.guard import Guard
from gateway.service.openai_format import chat_choice, chat_logprobs, usage
from gateway.service.openai_stream import chat_chunks
from gateway.service.request_schemas import ChatCompletionRequest, ChatRole, ToolCall
from gateway.service.response_schemas import ChatCompletion, ChatCompletionChunk
from gateway.service.sampling import check_top_logprobs
from gateway.service.state import GatewayState
from gateway.text.text_input import encode_chat
from gateway.text.tool_calls import ToolPlan, plan_tools, tools_system_prompt


async def chat_completion(
    state: GatewayState, body: ChatCompletionRequest, guard: Guard, response_id: str | None = None
) -> ChatCompletion | AsyncIterator[ChatCompletionChunk]:
    """A chat completion: the whole answer, or (`body.stream`) its chunks once the first token is
    there. `response_id` is the answer's `id` (a fresh "chatcmpl-..." when None)."""
    prompt_ids, plan = await chat_prompt_ids(state, body)
    return await complete_chat(state, body, guard, prompt_ids, plan, response_id)


async def chat_prompt_ids(state: GatewayState, body: ChatCompletionRequest) -> tuple[list[int], ToolPlan]:
    """The prompt's token ids (the messages through the chat template, tools included) and the tool
    plan; 404 for another model, 400 naming a bad field."""
    state.resolve_model(body.model)
    state.require_generation()
    tokenizer = state.require_tokenizer("messages")
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    messages, template_kwargs = _chat_prompt(body, plan, tokenizer.template_uses("tools"))
    if body.continue_final_message and body.messages[-1].role is not ChatRole.ASSISTANT:
        raise bad_request("continue_final_message needs the last message to be the assistant's", "messages")
    prompt_ids = await encode_chat(
        tokenizer,
        messages,
        "messages",
        state.pool.limits().context_len,
        add_generation_prompt=not body.continue_final_message,
        template_kwargs=template_kwargs,
        continue_final_message=body.continue_final_message,
    )
    return prompt_ids, plan


async def complete_chat(
    state: GatewayState,
    body: ChatCompletionRequest,
    guard: Guard,
    prompt_ids: list[int],
    plan: ToolPlan,
    response_id: str | None = None,
) -> ChatCompletion | AsyncIterator[ChatCompletionChunk]:
    """`chat_completion` from the prompt `chat_prompt_ids` gave for `body`."""
    tokenizer = state.require_tokenizer("messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    num_top = body.top_logprobs or 0
    check_top_logprobs(num_top, "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requests = choice_requests(state, body, [prompt_ids], body.n, max_tokens, param, num_top, plan)
    state.generation.check_batch_size(requests, "n")
    created, rid = int(time.time()), response_id or f"chatcmpl-{requests[0].request_id}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        started = await guard(state.generation.started_choices(requests))
        return chat_chunks(state, requests, started, body, rid, created, include_usage, num_top, plan)
    results = await guard(state.generation.gather(requests))
    choices = [
        chat_choice(
            index,
            result,
            plan,
            body.separate_reasoning,
            chat_logprobs(tokenizer, result.tokens, num_top) if body.logprobs else None,
        )
        for index, result in enumerate(results)
    ]
    return ChatCompletion(
        id=rid, created=created, model=body.model, choices=choices, usage=usage(len(prompt_ids), results, body.n)
    )


def _chat_prompt(body: ChatCompletionRequest, plan: ToolPlan, template_takes_tools: bool) -> tuple[list[dict], dict]:
    """Messages (and template arguments) for the chat template, tools included one way or the other."""
    messages = []
    for m in body.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if template_takes_tools:
                message["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
            else:  # show earlier calls in the same format we ask the model to use
                message["content"] += "".join(
                    f"<tool_call>{json.dumps({'name': c.function.name, 'arguments': _arguments(c)})}</tool_call>"
                    for c in m.tool_calls
                )
        messages.append(message)
    kwargs = dict(body.chat_template_kwargs or {})
    if plan.tools:
        if template_takes_tools:
            kwargs["tools"] = plan.tools
        elif messages and messages[0]["role"] is ChatRole.SYSTEM:
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + tools_system_prompt(plan.tools)}
        else:
            messages.insert(0, {"role": ChatRole.SYSTEM, "content": tools_system_prompt(plan.tools)})
    return messages, kwargs


def _arguments(call: ToolCall):
    arguments = call.function.arguments
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments
