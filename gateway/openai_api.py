"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from gateway.errors import APIError, bad_request
from gateway.generation import GenerationRequest, GenerationResult, generate_all, generate_text
from gateway.sampling import SamplingFields, build_sampling, check_token_ids, stop_list
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.state import GatewayState, gateway_state
from gateway.tokenizer import TokenizerError

router = APIRouter()


@router.get("/v1/models")
async def list_models(state: GatewayState = Depends(gateway_state)) -> dict:
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: GatewayState = Depends(gateway_state)) -> dict:
    state.check_model(model_id)
    return _model_card(state)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, state: GatewayState = Depends(gateway_state)):
    state.check_model(body.model)
    _reject_unsupported(body)
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in body.messages]
    try:
        prompt_ids = state.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except TokenizerError as exc:
        raise bad_request(str(exc), "messages") from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    request = _generation_request(state, body, prompt_ids, max_tokens, param)
    created, rid = int(time.time()), f"chatcmpl-{request.request_id}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_chat_chunks(state, request, body.model, rid, created, include_usage))
    result = await generate_all(state.pool, state.config, state.tokenizer, request)
    choice = {"index": 0, "message": {"role": "assistant", "content": result.text, "tool_calls": None},
              "logprobs": None, "finish_reason": _finish_name(result), "matched_stop": _matched(result)}
    return {"id": rid, "object": "chat.completion", "created": created, "model": body.model,
            "choices": [choice], "usage": _usage(len(prompt_ids), result)}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, state: GatewayState = Depends(gateway_state)):
    state.check_model(body.model)
    _reject_unsupported(body)
    if body.echo or body.logprobs is not None or body.suffix is not None or (body.best_of or 1) > 1:
        raise bad_request("echo, logprobs, suffix and best_of are not supported yet", "echo")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request("a list of several prompts is not supported yet; send one prompt", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        prompt_ids = state.tokenizer.encode(prompt)
    else:
        prompt_ids = list(prompt)
        check_token_ids(prompt_ids, state.pool.limits(), "prompt")
    request = _generation_request(state, body, prompt_ids, body.max_tokens, "max_tokens")
    created, rid = int(time.time()), f"cmpl-{request.request_id}"
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_completion_chunks(state, request, body.model, rid, created, include_usage))
    result = await generate_all(state.pool, state.config, state.tokenizer, request)
    choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": _finish_name(result),
              "matched_stop": _matched(result)}
    return {"id": rid, "object": "text_completion", "created": created, "model": body.model,
            "choices": [choice], "usage": _usage(len(prompt_ids), result)}


def _generation_request(state: GatewayState, body, prompt_ids: list[int], max_tokens: int | None,
                        max_tokens_param: str) -> GenerationRequest:
    fields = SamplingFields(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                            seed=body.seed, max_new_tokens=max_tokens,
                            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos)
    sampling = build_sampling(fields, len(prompt_ids), state.pool.limits(), state.config.sampling_defaults,
                              max_tokens_param)
    return GenerationRequest(prompt_ids, sampling, stop_list(body.stop), body.skip_special_tokens)


def _reject_unsupported(body) -> None:
    """Parameters the engine does not implement yet answer 400 instead of being silently ignored."""
    if body.n != 1:
        raise bad_request("n other than 1 is not supported yet", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported yet", name)
    if body.logit_bias:
        raise bad_request("logit_bias is not supported yet", "logit_bias")
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs or body.top_logprobs:
            raise bad_request("logprobs are not supported yet", "logprobs")
        if body.tools:
            raise bad_request("tools are not supported yet", "tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise bad_request("response_format other than text is not supported yet", "response_format")


async def _chat_chunks(state: GatewayState, request: GenerationRequest, model: str, rid: str, created: int,
                       include_usage: bool) -> AsyncIterator[dict]:
    def chunk(delta: dict, finish: str | None = None, matched=None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}

    yield chunk({"role": "assistant", "content": ""})
    result = GenerationResult()
    async for delta in generate_text(state.pool, state.config, state.tokenizer, request):
        result.add(delta)
        if delta.text:
            yield chunk({"content": delta.text})
        if delta.finish is not None:
            yield chunk({}, _finish_name(result), _matched(result))
    if include_usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": _usage(len(request.prompt_ids), result)}


async def _completion_chunks(state: GatewayState, request: GenerationRequest, model: str, rid: str, created: int,
                             include_usage: bool) -> AsyncIterator[dict]:
    result = GenerationResult()
    async for delta in generate_text(state.pool, state.config, state.tokenizer, request):
        result.add(delta)
        finish = _finish_name(result) if delta.finish is not None else None
        if delta.text or finish is not None:
            choice = {"index": 0, "text": delta.text, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["matched_stop"] = _matched(result)
            yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": _usage(len(request.prompt_ids), result)}


def sse_response(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events ending in `data: [DONE]`; an error after the first byte becomes an error event."""
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except APIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")


def _finish_name(result: GenerationResult) -> str | None:
    if result.finish is None:
        return None
    return result.finish.reason


def _matched(result: GenerationResult):
    return result.finish.matched if result.finish is not None else None


def _usage(prompt_tokens: int, result: GenerationResult) -> dict:
    completion = len(result.output_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": None}


def _model_card(state: GatewayState) -> dict:
    limits = state.pool.limits() if state.pool.is_ready else None
    card = {"id": state.config.served_model_name, "object": "model", "created": 0, "owned_by": "tandem",
            "root": state.config.model_path}
    if limits is not None:
        card["max_model_len"] = limits.context_len
    return card
