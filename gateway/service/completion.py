"""OpenAI's text completion, for every front (the HTTP route and the gRPC API): prompts as text or
token ids, best_of, echo and logprobs, the answer or its chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from gateway.errors import bad_request
from gateway.service.choice_requests import choice_requests
from gateway.service.generation import GenerationResult
from gateway.service.guard import Guard
from gateway.service.openai_format import (
    completion_logprobs,
    finish_name,
    join_completion_logprobs,
    matched_stop,
    prompt_completion_logprobs,
    usage,
)
from gateway.service.openai_stream import completion_chunks
from gateway.service.request_schemas import CompletionRequest
from gateway.service.response_schemas import Completion, CompletionChoice, CompletionChunk
from gateway.service.sampling import check_token_ids, check_top_logprobs
from gateway.service.state import GatewayState
from gateway.text.text_input import encode_texts
from tandem.limits import MAX_N


async def completion(
    state: GatewayState, body: CompletionRequest, guard: Guard, response_id: str | None = None
) -> Completion | AsyncIterator[CompletionChunk]:
    """A text completion: the whole answer, or (`body.stream`) its chunks once the first token is
    there. `response_id` is the answer's `id` (a fresh "cmpl-..." when None)."""
    state.resolve_model(body.model)
    state.require_generation()
    if body.suffix is not None:
        raise bad_request("suffix needs a model with a fill-in-the-middle template; this model has none", "suffix")
    num_top = body.logprobs or 0
    check_top_logprobs(num_top, "logprobs")
    best_of = body.best_of if body.best_of is not None else body.n
    if best_of < body.n:
        raise bad_request(f"best_of ({best_of}) must be >= n ({body.n})", "best_of")
    if best_of > MAX_N:
        raise bad_request(f"best_of must be between 1 and {MAX_N}, got {best_of}", "best_of")
    if best_of > body.n and body.stream:
        raise bad_request("best_of cannot be used with stream", "best_of")
    prompt_logprobs = body.echo and body.logprobs is not None
    prompts = await _completion_prompts(state, body.prompt)
    start = 0 if prompt_logprobs else None
    requests = choice_requests(
        state, body, prompts, best_of, body.max_tokens, "max_tokens", num_top, prompt_logprob_start=start
    )  # prompt-major: each prompt's best_of choices together
    state.generation.check_batch_size(requests, "prompt")
    created, rid = int(time.time()), response_id or f"cmpl-{requests[0].request_id}"
    echoes = [
        state.require_tokenizer("echo").decode(ids, skip_special_tokens=False) if body.echo else "" for ids in prompts
    ]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        started = await guard(state.generation.started_choices(requests))
        return completion_chunks(
            state, requests, started, body, rid, created, include_usage, echoes, num_top, len(prompts)
        )
    results = await guard(state.generation.gather(requests))
    choices = _completion_choices(state, body, prompts, results, best_of, echoes, num_top)
    return Completion(
        id=rid,
        created=created,
        model=body.model,
        choices=choices,
        usage=usage(sum(len(ids) for ids in prompts), results, best_of),
    )


def _completion_choices(
    state: GatewayState,
    body: CompletionRequest,
    prompts: list[list[int]],
    results: list[GenerationResult],
    best_of: int,
    echoes: list[str],
    num_top: int,
) -> list[CompletionChoice]:
    """Each prompt's `body.n` choices (the most likely of its `best_of` results), with the echoed prompt
    and its logprobs when asked for."""
    choices: list[CompletionChoice] = []
    for p, prompt_ids in enumerate(prompts):
        candidates = results[p * best_of : (p + 1) * best_of]
        if best_of > body.n:
            candidates = sorted(candidates, key=lambda r: -sum(t.logprob for t in r.tokens))[: body.n]
        for result in candidates:
            logprobs = None
            if body.logprobs is not None:
                tokenizer = state.require_tokenizer("logprobs")
                logprobs = completion_logprobs(tokenizer, result.tokens, num_top, len(echoes[p]))
                if body.echo:
                    logprobs = join_completion_logprobs(
                        prompt_completion_logprobs(tokenizer, prompt_ids, result.prompt_logprobs, num_top), logprobs
                    )
            choices.append(
                CompletionChoice(
                    index=len(choices),
                    text=echoes[p] + result.text,
                    logprobs=logprobs,
                    finish_reason=finish_name(result),
                    matched_stop=matched_stop(result),
                )
            )
    return choices


async def _completion_prompts(state: GatewayState, prompt) -> list[list[int]]:
    """A string, a list of strings, token ids, or a list of token-id lists -> token-id lists."""
    limits = state.pool.limits()
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        prompts = await encode_texts(state.require_tokenizer("prompt"), texts, "prompt", limits.context_len)
    elif prompt and isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    if not prompts or any(not ids for ids in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    for ids in prompts:
        check_token_ids(ids, limits, "prompt")
    return prompts
