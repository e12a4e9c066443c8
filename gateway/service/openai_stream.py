"""The chunks of OpenAI's streamed chat and text completions, from the generations' text deltas."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.records import FinishReason, TokenChunk
from gateway.service.generation import GenerationRequest, GenerationResult
from gateway.service.openai_format import (
    chat_logprobs,
    completion_logprobs,
    finish_name,
    matched_stop,
    prompt_completion_logprobs,
    tool_calls_out,
    usage,
)
from gateway.service.request_schemas import ChatCompletionRequest, ChatRole, CompletionRequest
from gateway.service.response_schemas import (
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatStreamChoice,
    ChoiceFinish,
    CompletionChunk,
    CompletionLogprobs,
    CompletionStreamChoice,
)
from gateway.service.state import GatewayState
from gateway.text.reasoning import ReasoningSplitter
from gateway.text.tool_calls import ToolPlan, parse_tool_calls


async def chat_chunks(
    state: GatewayState,
    requests: list[GenerationRequest],
    choices: AsyncIterator[tuple[int, TokenChunk]],
    body: ChatCompletionRequest,
    rid: str,
    created: int,
    include_usage: bool,
    num_top: int,
    plan: ToolPlan,
) -> AsyncIterator[ChatCompletionChunk]:
    """Content streams as it comes; with tools, each choice's text is held until it finishes and then
    sent as tool_calls deltas (or as content, if it holds no call)."""

    def chunk(
        index: int,
        delta: ChatDelta,
        logprobs: ChatLogprobs | None = None,
        finish: ChoiceFinish | None = None,
        matched: str | int | None = None,
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=rid,
            created=created,
            model=body.model,
            choices=[
                ChatStreamChoice(
                    index=index, delta=delta, logprobs=logprobs, finish_reason=finish, matched_stop=matched
                )
            ],
        )

    tokenizer = state.require_tokenizer("messages")
    for index in range(len(requests)):
        yield chunk(index, ChatDelta(role=ChatRole.ASSISTANT, content=""))
    results = [GenerationResult() for _ in requests]
    splitters = [ReasoningSplitter() if body.separate_reasoning else None for _ in requests]
    async for index, delta in choices:
        result = results[index]
        result.add(delta)
        logprobs = chat_logprobs(tokenizer, delta.tokens, num_top) if body.logprobs else None
        if plan.parses_calls:
            if delta.finish is None:
                continue
            content, calls = parse_tool_calls(result.text, plan)
            if calls:
                yield chunk(index, ChatDelta(tool_calls=tool_calls_out(calls, is_delta=True)))
            elif content:
                yield chunk(index, ChatDelta(content=content))
            yield chunk(index, ChatDelta(), None, "tool_calls" if calls else finish_name(result), matched_stop(result))
            continue
        reasoning, content = _split_delta(splitters[index], delta.text, delta.finish is not None)
        if reasoning:
            yield chunk(index, ChatDelta(reasoning_content=reasoning))
        if content or (logprobs and delta.finish is None):
            yield chunk(index, ChatDelta(content=content), logprobs)
            logprobs = None
        if delta.finish is not None:
            yield chunk(index, ChatDelta(), logprobs, finish_name(result), matched_stop(result))
    if include_usage:
        yield ChatCompletionChunk(
            id=rid,
            created=created,
            model=body.model,
            choices=[],
            usage=usage(len(requests[0].prompt_ids), results, body.n),
        )


def _split_delta(splitter: ReasoningSplitter | None, text: str, is_last: bool) -> tuple[str, str]:
    if splitter is None:
        return "", text
    reasoning, content = splitter.feed(text)
    if is_last:
        tail_reasoning, tail_content = splitter.flush()
        reasoning, content = reasoning + tail_reasoning, content + tail_content
    return reasoning, content


async def completion_chunks(
    state: GatewayState,
    requests: list[GenerationRequest],
    choices: AsyncIterator[tuple[int, TokenChunk]],
    body: CompletionRequest,
    rid: str,
    created: int,
    include_usage: bool,
    echoes: list[str],
    num_top: int,
    num_prompts: int,
) -> AsyncIterator[CompletionChunk]:
    """Text as it comes, each prompt's `echoes` first; `requests` hold each prompt's choices in turn."""

    def chunk(
        index: int,
        text: str,
        logprobs: CompletionLogprobs | None = None,
        finish: FinishReason | None = None,
        matched: str | int | None = None,
    ) -> CompletionChunk:
        return CompletionChunk(
            id=rid,
            created=created,
            model=body.model,
            choices=[
                CompletionStreamChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=finish, matched_stop=matched
                )
            ],
        )

    per_prompt = len(requests) // num_prompts
    # With logprobs, each echo waits for its choice's first token, which brings the prompt's logprobs.
    echo_pending = [bool(echoes[i // per_prompt]) and body.logprobs is not None for i in range(len(requests))]
    for index in range(len(requests)):
        if echoes[index // per_prompt] and not echo_pending[index]:
            yield chunk(index, echoes[index // per_prompt])
    results = [GenerationResult() for _ in requests]
    offsets = [len(echoes[i // per_prompt]) for i in range(len(requests))]
    async for index, delta in choices:
        results[index].add(delta)
        if echo_pending[index]:
            echo_pending[index] = False
            yield chunk(
                index,
                echoes[index // per_prompt],
                prompt_completion_logprobs(
                    state.require_tokenizer("logprobs"), requests[index].prompt_ids, delta.prompt_logprobs, num_top
                ),
            )
        logprobs = (
            completion_logprobs(state.require_tokenizer("logprobs"), delta.tokens, num_top, offsets[index])
            if body.logprobs is not None
            else None
        )
        offsets[index] += len(delta.text)
        finish = finish_name(results[index]) if delta.finish is not None else None
        if delta.text or finish is not None or logprobs:
            yield chunk(index, delta.text, logprobs, finish, matched_stop(results[index]) if finish else None)
    if include_usage:
        prompt_lens = sum(len(requests[p * per_prompt].prompt_ids) for p in range(num_prompts))
        yield CompletionChunk(
            id=rid, created=created, model=body.model, choices=[], usage=usage(prompt_lens, results, per_prompt)
        )
