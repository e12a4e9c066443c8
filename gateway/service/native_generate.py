"""SGLang's native /generate for every front (the HTTP route and the gRPC API): one prompt or a batch,
each with `n` samples, answered whole or as a stream in the response shape of SGLang's quick start."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from gateway.caller import checked_priority
from gateway.errors import bad_request
from gateway.records import Finish, FinishReason, TokenChunk
from gateway.service.generation import GenerationRequest, GenerationResult
from gateway.service.guard import Guard
from gateway.service.native_logprobs import LogprobOptions, logprob_fields, logprob_options
from gateway.service.request_schemas import GenerateRequest, NativeSamplingParams
from gateway.service.response_schemas import (
    AbortFinish,
    GenerateResponse,
    LengthFinish,
    MetaInfo,
    NativeLogprobs,
    StopFinish,
    TandemTimings,
)
from gateway.service.sampling import build_sampling, check_token_ids, output_constraint, stop_list
from gateway.service.state import GatewayState
from gateway.text.text_input import encode_texts, token_id_lists
from tandem.limits import MAX_N
from tandem.sampling import SamplingSpec


async def run_generate(
    state: GatewayState, body: GenerateRequest, guard: Guard
) -> GenerateResponse | list[GenerateResponse] | AsyncIterator[GenerateResponse]:
    """/generate for every front: one prompt, or a batch (`text` / `input_ids` as lists), each with
    `n` samples. A single prompt with n == 1 answers one object; anything else a list, in
    prompt-major order; `body.stream` answers the stream's events once the first token is there."""
    arrived_at = time.perf_counter()
    state.require_generation()
    limits = state.pool.limits()
    prompts, is_batch = await _prompts(body, state, limits)
    param_sets = (
        body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params] * len(prompts)
    )
    if len(param_sets) != len(prompts):
        raise bad_request(f"{len(param_sets)} sampling_params for {len(prompts)} prompts", "sampling_params")
    rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
    if len(rids) != len(prompts):
        raise bad_request(f"{len(rids)} rids for {len(prompts)} prompts", "rid")
    loras = _lora_names(state, body, len(prompts))
    requests: list[GenerationRequest] = []
    options: list[LogprobOptions] = []
    for prompt_ids, params, rid, logprobs, lora_name in zip(
        prompts, param_sets, rids, logprob_options(body, prompts), loras
    ):
        choices = _requests_for(state, body, limits, prompt_ids, params, rid, logprobs, arrived_at, lora_name)
        requests += choices
        options += [logprobs] * len(choices)
    state.generation.check_batch_size(requests, "text" if body.text is not None else "input_ids")
    if body.stream:
        started = await guard(state.generation.started_choices(requests))
        return _stream(state, body, requests, started, options, arrived_at, is_batch or len(requests) > 1)
    results = await guard(state.generation.gather(requests))
    answers = [_response(state, body, r, o, res, arrived_at) for r, o, res in zip(requests, options, results)]
    return answers if is_batch or len(answers) > 1 else answers[0]


def _lora_names(state: GatewayState, body: GenerateRequest, num_prompts: int) -> list[str]:
    """Each prompt's adapter ("" the base model) from SGLang's `lora_path`: one name (or None) for
    every prompt, or a list of one per prompt; an adapter no worker holds is a 404."""
    paths = body.lora_path if isinstance(body.lora_path, list) else [body.lora_path] * num_prompts
    if len(paths) != num_prompts:
        raise bad_request(f"{len(paths)} lora_path entries for {num_prompts} prompts", "lora_path")
    return [state.resolve_model(path, "lora_path") if path else "" for path in paths]


async def _prompts(body: GenerateRequest, state: GatewayState, limits) -> tuple[list[list[int]], bool]:
    if body.text is not None and body.input_ids is None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        prompts = await encode_texts(state.require_tokenizer("text"), texts, "text", limits.context_len)
        return prompts, isinstance(body.text, list)
    if body.input_ids is not None and body.text is None:
        prompts, is_batch = token_id_lists(body.input_ids)
        for ids in prompts:
            check_token_ids(ids, limits, "input_ids")
        return prompts, is_batch
    raise bad_request("exactly one of `text` and `input_ids` is required", "text")


def _requests_for(
    state: GatewayState,
    body: GenerateRequest,
    limits,
    prompt_ids: list[int],
    p: NativeSamplingParams,
    rid: str | None,
    logprobs: LogprobOptions,
    arrived_at: float,
    lora_name: str,
) -> list[GenerationRequest]:
    n = p.n
    if not (1 <= n <= MAX_N):
        raise bad_request(f"sampling_params.n must be an integer between 1 and {MAX_N}", "sampling_params.n")
    max_new_tokens = p.max_new_tokens if "max_new_tokens" in p.model_fields_set else state.config.default_max_new_tokens
    spec = SamplingSpec(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed if p.seed is not None else p.sampling_seed,
        max_new_tokens=max_new_tokens,
        stop_token_ids=tuple(p.stop_token_ids or ()),
        ignore_eos=p.ignore_eos,
        min_new_tokens=p.min_new_tokens,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        top_logprobs_num=logprobs.top_num,
        token_ids_logprob=logprobs.token_ids,
        grammar=output_constraint(p.json_schema, p.regex, p.ebnf, schema_param="sampling_params.json_schema"),
    )
    sampling = build_sampling(
        spec,
        len(prompt_ids),
        limits,
        state.config.sampling_defaults,
        "sampling_params.max_new_tokens",
        "text" if body.text is not None else "input_ids",
    )
    stops = stop_list(p.stop)
    if stops:
        state.require_tokenizer("sampling_params.stop")
    priority = checked_priority(body.priority)
    requests = []
    for i in range(n):
        ids = {"request_id": rid if n == 1 else f"{rid}-{i}"} if rid else {}
        requests.append(
            GenerationRequest(
                prompt_ids,
                sampling,
                stops,
                p.skip_special_tokens,
                **ids,
                spaces_between_special_tokens=p.spaces_between_special_tokens,
                no_stop_trim=p.no_stop_trim,
                arrived_at=arrived_at,
                prompt_logprob_start=logprobs.prompt_start,
                priority=priority,
                lora_name=lora_name,
            )
        )
    return requests


async def _stream(
    state: GatewayState,
    body: GenerateRequest,
    requests: list[GenerationRequest],
    choices: AsyncIterator[tuple[int, TokenChunk]],
    options: list[LogprobOptions],
    started: float,
    with_index: bool,
) -> AsyncIterator[GenerateResponse]:
    """Each event carries the cumulative text of its prompt so far, as SGLang's stream does
    (plus `index` when several generations share the stream)."""
    results = [GenerationResult() for _ in requests]
    async for index, delta in choices:
        results[index].add(delta)
        if delta.text or delta.finish is not None:
            yield _response(
                state, body, requests[index], options[index], results[index], started, index if with_index else None
            )


def _response(
    state: GatewayState,
    body: GenerateRequest,
    request: GenerationRequest,
    logprobs: LogprobOptions,
    result: GenerationResult,
    started: float,
    index: int | None = None,
) -> GenerateResponse:
    meta = MetaInfo(
        id=request.request_id,
        finish_reason=_finish_reason(result.finish, len(result.output_ids)),
        prompt_tokens=len(request.prompt_ids),
        completion_tokens=len(result.output_ids),
        cached_tokens=result.timings.cached_tokens if result.timings else 0,
        e2e_latency=time.perf_counter() - started,
        tandem_timings=_timings(result),
        spec_verify_ct=result.spec_verify_ct or None,
        spec_accepted_tokens=result.spec_accepted_tokens if result.spec_verify_ct else None,
        **dict(_logprobs(state, body, request, logprobs, result)),
    )
    if state.tokenizer is None:  # tokenizer-free servers answer ids only, as SGLang does
        return GenerateResponse(token_ids=result.output_ids, output_ids=result.output_ids, meta_info=meta, index=index)
    return GenerateResponse(text=result.text, output_ids=result.output_ids, meta_info=meta, index=index)


def _timings(result: GenerationResult) -> TandemTimings | None:
    if (t := result.timings) is None:
        return None
    return TandemTimings(
        gateway_queue_ms=t.gateway_queue_ms,
        reserve_ms=t.reserve_ms,
        prefill_queue_ms=t.prefill_queue_ms,
        prefill_compute_ms=t.prefill_compute_ms,
        kv_transfer_ms=t.transfer_ms,
        kv_bytes=t.kv_bytes,
        decode_queue_ms=t.decode_queue_ms,
        first_token_ms=t.gateway_queue_ms + t.first_token_ms,
        prefill_path=t.prefill_path.value,
        decode_cached_tokens=t.decode_cached_tokens,
    )


def _logprobs(
    state: GatewayState,
    body: GenerateRequest,
    request: GenerationRequest,
    logprobs: LogprobOptions,
    result: GenerationResult,
) -> NativeLogprobs:
    if not logprobs.is_on:
        return NativeLogprobs()
    if not body.return_text_in_logprobs:
        return logprob_fields(logprobs, request, result, None)
    tokenizer = state.require_tokenizer("return_text_in_logprobs")

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return logprob_fields(logprobs, request, result, token_text)


def _finish_reason(finish: Finish | None, num_tokens: int) -> LengthFinish | StopFinish | AbortFinish | None:
    if finish is None:
        return None
    if finish.reason is FinishReason.LENGTH:
        return LengthFinish(length=num_tokens)
    if finish.reason is FinishReason.STOP:
        return StopFinish(matched=finish.matched)
    return AbortFinish(message=finish.message)
