"""OpenAI response pieces: logprobs in chat and completions shapes, tool calls, usage, finish fields."""

from __future__ import annotations

from typing import Any, TypeVar

from gateway.records import FinishReason, GeneratedToken
from gateway.service.generation import GenerationResult
from gateway.service.response_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatLogprobs,
    CompletionLogprobs,
    FunctionCall,
    PromptTokensDetails,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from gateway.text.reasoning import split_reasoning
from gateway.text.tokenizer import Tokenizer
from gateway.text.tool_calls import ToolCall, ToolPlan, parse_tool_calls

_Entry = TypeVar("_Entry", bound=TopLogprob)


def chat_choice(
    index: int, result: GenerationResult, plan: ToolPlan, separate_reasoning: bool, logprobs: ChatLogprobs | None
) -> ChatChoice:
    """One whole chat choice: the tool calls parsed out of its text when the request has tools, and its
    reasoning apart from the content when asked to."""
    content, calls = parse_tool_calls(result.text, plan) if plan.parses_calls else (result.text, [])
    reasoning = None
    if separate_reasoning and content:
        reasoning, content = split_reasoning(content)
    message = AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=tool_calls_out(calls) or None)
    return ChatChoice(
        index=index,
        message=message,
        logprobs=logprobs,
        finish_reason="tool_calls" if calls else finish_name(result),
        matched_stop=matched_stop(result),
    )


def chat_logprobs(tokenizer: Tokenizer, tokens: list[GeneratedToken], num_top: int) -> ChatLogprobs:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}` for these tokens."""

    def entry(kind: type[_Entry], token_id: int, logprob: float, **more: Any) -> _Entry:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return kind(token=text, logprob=logprob, bytes=list(text.encode("utf-8")), **more)

    return ChatLogprobs(
        content=[
            entry(
                TokenLogprob,
                t.token_id,
                t.logprob,
                top_logprobs=[entry(TopLogprob, i, lp) for i, lp in t.top[:num_top]],
            )
            for t in tokens
        ]
    )


def completion_logprobs(
    tokenizer: Tokenizer, tokens: list[GeneratedToken], num_top: int, text_offset: int
) -> CompletionLogprobs:
    """Legacy completions shape: parallel lists of tokens, logprobs, top dicts and text offsets."""
    texts = [tokenizer.decode([t.token_id], skip_special_tokens=False) for t in tokens]
    offsets, position = [], text_offset
    for text in texts:
        offsets.append(position)
        position += len(text)
    return CompletionLogprobs(
        tokens=texts,
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[
            {tokenizer.decode([i], skip_special_tokens=False): lp for i, lp in t.top[:num_top]} for t in tokens
        ],
        text_offset=offsets,
    )


def prompt_completion_logprobs(
    tokenizer: Tokenizer, prompt_ids: list[int], scored: list[GeneratedToken], num_top: int
) -> CompletionLogprobs:
    """The echoed prompt's part of the legacy shape (`echo` with `logprobs`): the first token has no
    logprob (None, and None for its top dict); the others come from the prefill server's scoring."""
    first = GeneratedToken(prompt_ids[0], 0.0)
    part = completion_logprobs(tokenizer, [first, *scored], num_top, 0)
    part.token_logprobs[0] = None
    part.top_logprobs[0] = None
    return part


def join_completion_logprobs(head: CompletionLogprobs, tail: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=head.tokens + tail.tokens,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
        text_offset=head.text_offset + tail.text_offset,
    )


def tool_calls_out(calls: list[ToolCall], is_delta: bool = False) -> list[ToolCallOut]:
    """The calls parsed out of a choice's text; a stream delta numbers them (`index`)."""
    return [
        ToolCallOut(
            index=i if is_delta else None, id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments)
        )
        for i, call in enumerate(calls)
    ]


def finish_name(result: GenerationResult) -> FinishReason | None:
    return result.finish.reason if result.finish is not None else None


def matched_stop(result: GenerationResult) -> str | int | None:
    return result.finish.matched if result.finish is not None else None


def usage(prompt_tokens: int, results: list[GenerationResult], choices_per_prompt: int = 1) -> Usage:
    """`prompt_tokens` counts each prompt once (its n choices share it); completion tokens add up
    over every choice. `cached_tokens` are the prefill server's prefix-cache hits for each prompt's
    first choice, so they never exceed `prompt_tokens`."""
    completion = sum(len(r.output_ids) for r in results)
    firsts = results[::choices_per_prompt]
    cached = sum(r.timings.cached_tokens for r in firsts if r.timings is not None)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=min(cached, prompt_tokens)),
    )
