"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Depends, Request

from gateway.api.disconnect import cancel_on_disconnect
from gateway.api.json_route import JSONRoute
from gateway.api.openai_format import (
    chat_choice,
    chat_logprobs,
    completion_logprobs,
    finish_name,
    join_completion_logprobs,
    matched_stop,
    prompt_completion_logprobs,
    usage,
)
from gateway.api.openai_stream import chat_chunks, completion_chunks
from gateway.api.responses import ChatCompletion, Completion, CompletionChoice, ModelCard, ModelList
from gateway.api.schemas import ChatCompletionRequest, ChatRole, CompletionRequest, ToolCall
from gateway.api.sse import sse_response
from gateway.errors import bad_request
from gateway.service.generation import GenerationRequest, GenerationResult
from gateway.service.sampling import (
    SamplingFields,
    build_sampling,
    check_token_ids,
    check_top_logprobs,
    output_constraint,
    parse_logit_bias,
    stop_list,
)
from gateway.state import GatewayState, gateway_state
from gateway.text.text_input import encode_chat, encode_texts
from gateway.text.tool_calls import ToolPlan, plan_tools, tools_system_prompt
from tandem.limits import MAX_N

router = APIRouter(route_class=JSONRoute)


@router.get("/v1/models")
async def list_models(state: GatewayState = Depends(gateway_state)) -> ModelList:
    return ModelList(data=[_model_card(state)])


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: GatewayState = Depends(gateway_state)) -> ModelCard:
    state.check_model(model_id)
    return _model_card(state)


@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(
    body: ChatCompletionRequest, http_request: Request, state: GatewayState = Depends(gateway_state)
):
    state.check_model(body.model)
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
        started = await cancel_on_disconnect(http_request, state.generation.started_choices(requests))
        return sse_response(chat_chunks(state, requests, started, body, rid, created, include_usage, num_top, plan))
    results = await cancel_on_disconnect(http_request, state.generation.gather(requests))
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


@router.post("/v1/completions", response_model=Completion)
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
    start = 0 if prompt_logprobs else None
    requests = _choice_requests(
        state, body, prompts, best_of, body.max_tokens, "max_tokens", num_top, prompt_logprob_start=start
    )  # prompt-major: each prompt's best_of choices together
    state.generation.check_batch_size(requests, "prompt")
    created, rid = int(time.time()), f"cmpl-{requests[0].request_id}"
    echoes = [
        state.require_tokenizer("echo").decode(ids, skip_special_tokens=False) if body.echo else "" for ids in prompts
    ]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        started = await cancel_on_disconnect(http_request, state.generation.started_choices(requests))
        return sse_response(
            completion_chunks(
                state, requests, started, body, rid, created, include_usage, echoes, num_top, len(prompts)
            )
        )
    results = await cancel_on_disconnect(http_request, state.generation.gather(requests))
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


def _choice_requests(
    state: GatewayState,
    body,
    prompts: list[list[int]],
    n: int,
    max_tokens: int | None,
    max_tokens_param: str,
    num_top: int,
    plan: ToolPlan | None = None,
    prompt_logprob_start: int | None = None,
) -> list[GenerationRequest]:
    if not (1 <= n <= MAX_N):
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", "n")
    requests = []
    for prompt_ids in prompts:
        fields = SamplingFields(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            max_new_tokens=max_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            min_new_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=parse_logit_bias(body.logit_bias),
            top_logprobs_num=num_top,
            constraint=_constraint(body, plan),
        )
        sampling = build_sampling(
            fields,
            len(prompt_ids),
            state.pool.limits(),
            state.config.sampling_defaults,
            max_tokens_param,
            "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
        )
        for i in range(n):
            choice_sampling = sampling
            if body.seed is not None and i:
                choice_sampling = sampling.with_seed((body.seed + i) % 2**63)  # distinct but reproducible choices
            requests.append(
                GenerationRequest(
                    prompt_ids,
                    choice_sampling,
                    _stops(state, body.stop),
                    body.skip_special_tokens,
                    spaces_between_special_tokens=body.spaces_between_special_tokens,
                    no_stop_trim=body.no_stop_trim,
                    prompt_logprob_start=prompt_logprob_start,
                )
            )
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
                raise bad_request(
                    'response_format json_schema needs {"json_schema": {"name", "schema"}}', "response_format"
                )
            schema = spec["schema"]
        elif kind != "text":
            raise bad_request(
                f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format"
            )
    if plan is not None and plan.forced_schema is not None:
        if schema is not None or json_object:
            raise bad_request("tool_choice required or named cannot be combined with response_format", "tool_choice")
        schema = plan.forced_schema
    return output_constraint(schema, body.regex, body.ebnf, json_object, "response_format")


def _model_card(state: GatewayState) -> ModelCard:
    return ModelCard(
        id=state.config.served_model_name,
        created=state.started_at,
        root=state.config.model_path,
        max_model_len=state.pool.limits().context_len if state.pool.is_ready else None,
    )
