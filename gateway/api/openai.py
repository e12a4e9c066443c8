"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request

from gateway.api.disconnect import cancel_on_disconnect
from gateway.errors import bad_request
from gateway.service.generation import GenerationRequest, GenerationResult, TextDelta
from gateway.api.json_route import JSONRoute
from gateway.api.openai_format import (chat_logprobs, completion_logprobs, finish_name, join_completion_logprobs,
                                   matched_stop, prompt_completion_logprobs, usage)
from gateway.service.sampling import (SamplingFields, build_sampling, check_token_ids, check_top_logprobs, output_constraint,
                              parse_logit_bias, stop_list)
from gateway.api.schemas import ChatCompletionRequest, CompletionRequest, ToolCall
from gateway.api.sse import sse_response
from gateway.state import GatewayState, gateway_state
from gateway.text.text_input import encode_chat, encode_texts
from gateway.text.reasoning import ReasoningSplitter, split_reasoning
from gateway.text.tool_calls import ToolPlan, parse_tool_calls, plan_tools, tools_system_prompt

router = APIRouter(route_class=JSONRoute)

MAX_N = 64


@router.get("/v1/models")
async def list_models(state: GatewayState = Depends(gateway_state)) -> dict:
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: GatewayState = Depends(gateway_state)) -> dict:
    state.check_model(model_id)
    return _model_card(state)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http_request: Request,
                           state: GatewayState = Depends(gateway_state)):
    state.check_model(body.model)
    state.require_generation()
    tokenizer = state.require_tokenizer("messages")
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    messages, template_kwargs = _chat_prompt(body, plan, tokenizer.template_uses("tools"))
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs the last message to be the assistant's", "messages")
    prompt_ids = await encode_chat(tokenizer, messages, "messages", state.pool.limits().context_len,
                                   add_generation_prompt=not body.continue_final_message,
                                   template_kwargs=template_kwargs, continue_final_message=body.continue_final_message)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    num_top = body.top_logprobs or 0
    check_top_logprobs(num_top, "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    requests = _choice_requests(state, body, [prompt_ids], body.n, max_tokens, param, num_top, plan)
    state.generation.check_batch_size(requests, "n")
    created, rid = int(time.time()), f"chatcmpl-{requests[0].request_id}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        choices = await cancel_on_disconnect(http_request, state.generation.started_choices(requests))
        return sse_response(_chat_chunks(state, requests, choices, body, rid, created, include_usage, num_top, plan))
    results = await cancel_on_disconnect(http_request, state.generation.gather(requests))
    choices = []
    for index, result in enumerate(results):
        content, calls = parse_tool_calls(result.text, plan) if plan.parses_calls else (result.text, [])
        reasoning = None
        if body.separate_reasoning and content:
            reasoning, content = split_reasoning(content)
        choices.append({"index": index,
                        "message": {"role": "assistant", "content": content, "reasoning_content": reasoning,
                                    "tool_calls": [c.to_openai() for c in calls] or None},
                        "logprobs": chat_logprobs(tokenizer, result.tokens, num_top) if body.logprobs else None,
                        "finish_reason": "tool_calls" if calls else finish_name(result),
                        "matched_stop": matched_stop(result)})
    return {"id": rid, "object": "chat.completion", "created": created, "model": body.model, "choices": choices,
            "usage": usage(len(prompt_ids), results, body.n)}


def _chat_prompt(body: ChatCompletionRequest, plan: ToolPlan, template_takes_tools: bool) -> tuple[list[dict], dict]:
    """Messages (and template arguments) for the chat template, tools included one way or the other."""
    messages = []
    for m in body.messages:
        message = {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if template_takes_tools:
                message["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
            else:   # show earlier calls in the same format we ask the model to use
                message["content"] += "".join(
                    f"<tool_call>{json.dumps({'name': c.function.name, 'arguments': _arguments(c)})}</tool_call>"
                    for c in m.tool_calls)
        messages.append(message)
    kwargs = dict(body.chat_template_kwargs or {})
    if plan.tools:
        if template_takes_tools:
            kwargs["tools"] = plan.tools
        elif messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + tools_system_prompt(plan.tools)}
        else:
            messages.insert(0, {"role": "system", "content": tools_system_prompt(plan.tools)})
    return messages, kwargs


def _arguments(call: ToolCall):
    arguments = call.function.arguments
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http_request: Request, state: GatewayState = Depends(gateway_state)):
    state.check_model(body.model)
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
    requests = [r for ids in prompts for r in _choice_requests(state, body, [ids], best_of, body.max_tokens,
                                                                 "max_tokens", num_top,
                                                                 prompt_logprob_start=0 if prompt_logprobs else None)]
    state.generation.check_batch_size(requests, "prompt")
    created, rid = int(time.time()), f"cmpl-{requests[0].request_id}"
    echoes = [state.require_tokenizer("echo").decode(ids, skip_special_tokens=False) if body.echo else ""
              for ids in prompts]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        choices = await cancel_on_disconnect(http_request, state.generation.started_choices(requests))
        return sse_response(_completion_chunks(state, requests, choices, body, rid, created, include_usage, echoes,
                                               num_top, len(prompts)))
    results = await cancel_on_disconnect(http_request, state.generation.gather(requests))
    choices = []
    for p, prompt_ids in enumerate(prompts):
        candidates = results[p * best_of:(p + 1) * best_of]
        if best_of > body.n:
            candidates = sorted(candidates, key=lambda r: -sum(t.logprob for t in r.tokens))[:body.n]
        for result in candidates:
            logprobs = None
            if body.logprobs is not None:
                tokenizer = state.require_tokenizer("logprobs")
                logprobs = completion_logprobs(tokenizer, result.tokens, num_top, len(echoes[p]))
                if prompt_logprobs:
                    logprobs = join_completion_logprobs(
                        prompt_completion_logprobs(tokenizer, prompt_ids, result.prompt_logprobs, num_top), logprobs)
            choices.append({"index": len(choices), "text": echoes[p] + result.text, "logprobs": logprobs,
                            "finish_reason": finish_name(result), "matched_stop": matched_stop(result)})
    prompt_lens = sum(len(ids) for ids in prompts)
    report = usage(prompt_lens, results, best_of)
    return {"id": rid, "object": "text_completion", "created": created, "model": body.model, "choices": choices,
            "usage": report}


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


def _choice_requests(state: GatewayState, body, prompts: list[list[int]], n: int, max_tokens: int | None,
                     max_tokens_param: str, num_top: int, plan: ToolPlan | None = None,
                     prompt_logprob_start: int | None = None) -> list[GenerationRequest]:
    if not (1 <= n <= MAX_N):
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", "n")
    requests = []
    for prompt_ids in prompts:
        fields = SamplingFields(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
            max_new_tokens=max_tokens, stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            min_new_tokens=body.min_tokens, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
            logit_bias=parse_logit_bias(body.logit_bias), top_logprobs_num=num_top,
            constraint=_constraint(body, plan))
        sampling = build_sampling(fields, len(prompt_ids), state.pool.limits(), state.config.sampling_defaults,
                                  max_tokens_param, "messages" if isinstance(body, ChatCompletionRequest) else "prompt")
        for i in range(n):
            choice_sampling = type(sampling)()
            choice_sampling.CopyFrom(sampling)
            if body.seed is not None and i:
                choice_sampling.seed = (body.seed + i) % 2**63   # distinct but reproducible choices
            requests.append(GenerationRequest(
                prompt_ids, choice_sampling, _stops(state, body.stop), body.skip_special_tokens,
                spaces_between_special_tokens=body.spaces_between_special_tokens, no_stop_trim=body.no_stop_trim,
                prompt_logprob_start=prompt_logprob_start))
    return requests


def _stops(state: GatewayState, stop) -> tuple[str, ...]:
    stops = stop_list(stop)
    if stops:
        state.require_tokenizer("stop")
    return stops


def _constraint(body, plan: ToolPlan | None = None) -> tuple[str, str] | None:
    """response_format (chat), a forced tool call, or SGLang's regex / ebnf -> one output constraint."""
    schema, json_object = None, False
    response_format = getattr(body, "response_format", None)
    if response_format:
        kind = response_format.get("type", "text")
        if kind == "json_object":
            json_object = True
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise bad_request("response_format json_schema needs {\"json_schema\": {\"name\", \"schema\"}}",
                                  "response_format")
            schema = spec["schema"]
        elif kind != "text":
            raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                              "response_format")
    if plan is not None and plan.forced_schema is not None:
        if schema is not None or json_object:
            raise bad_request("tool_choice required or named cannot be combined with response_format", "tool_choice")
        schema = plan.forced_schema
    return output_constraint(schema, body.regex, body.ebnf, json_object, "response_format")


async def _chat_chunks(state: GatewayState, requests: list[GenerationRequest],
                       choices: AsyncIterator[tuple[int, TextDelta]], body: ChatCompletionRequest, rid: str,
                       created: int, include_usage: bool, num_top: int, plan: ToolPlan) -> AsyncIterator[dict]:
    """Content streams as it comes; with tools, each choice's text is held until it finishes and then
    sent as tool_calls deltas (or as content, if it holds no call)."""
    def chunk(index: int, delta: dict, logprobs=None, finish: str | None = None, matched=None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                "choices": [choice]}

    tokenizer = state.tokenizer
    for index in range(len(requests)):
        yield chunk(index, {"role": "assistant", "content": ""})
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
                yield chunk(index, {"tool_calls": [c.to_openai(i) for i, c in enumerate(calls)]})
            elif content:
                yield chunk(index, {"content": content})
            yield chunk(index, {}, None, "tool_calls" if calls else finish_name(result), matched_stop(result))
            continue
        reasoning, content = _split_delta(splitters[index], delta.text, delta.finish is not None)
        if reasoning:
            yield chunk(index, {"reasoning_content": reasoning})
        if content or (logprobs and delta.finish is None):
            yield chunk(index, {"content": content}, logprobs)
            logprobs = None
        if delta.finish is not None:
            yield chunk(index, {}, logprobs, finish_name(result), matched_stop(result))
    if include_usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model, "choices": [],
               "usage": usage(len(requests[0].prompt_ids), results, body.n)}


def _split_delta(splitter: ReasoningSplitter | None, text: str, is_last: bool) -> tuple[str, str]:
    if splitter is None:
        return "", text
    reasoning, content = splitter.feed(text)
    if is_last:
        tail_reasoning, tail_content = splitter.flush()
        reasoning, content = reasoning + tail_reasoning, content + tail_content
    return reasoning, content


async def _completion_chunks(state: GatewayState, requests: list[GenerationRequest],
                             choices: AsyncIterator[tuple[int, TextDelta]], body: CompletionRequest, rid: str,
                             created: int, include_usage: bool, echoes: list[str], num_top: int,
                             num_prompts: int) -> AsyncIterator[dict]:
    def chunk(index: int, text: str, logprobs=None, finish: str | None = None, matched=None) -> dict:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched
        return {"id": rid, "object": "text_completion", "created": created, "model": body.model, "choices": [choice]}

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
            yield chunk(index, echoes[index // per_prompt], prompt_completion_logprobs(
                state.require_tokenizer("logprobs"), requests[index].prompt_ids, delta.prompt_logprobs, num_top))
        logprobs = (completion_logprobs(state.require_tokenizer("logprobs"), delta.tokens, num_top, offsets[index])
                    if body.logprobs is not None else None)
        offsets[index] += len(delta.text)
        finish = finish_name(results[index]) if delta.finish is not None else None
        if delta.text or finish is not None or logprobs:
            yield chunk(index, delta.text, logprobs, finish, matched_stop(results[index]) if finish else None)
    if include_usage:
        prompt_lens = sum(len(requests[p * per_prompt].prompt_ids) for p in range(num_prompts))
        yield {"id": rid, "object": "text_completion", "created": created, "model": body.model, "choices": [],
               "usage": usage(prompt_lens, results, per_prompt)}


def _model_card(state: GatewayState) -> dict:
    limits = state.pool.limits() if state.pool.is_ready else None
    card = {"id": state.config.served_model_name, "object": "model", "created": 0, "owned_by": "tandem",
            "root": state.config.model_path}
    if limits is not None:
        card["max_model_len"] = limits.context_len
    return card


