"""SGLang's native routes: /generate (the response shape of SGLang's quick start), /health."""

from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from gateway.errors import bad_request
from gateway.generation import Finish, GenerationRequest, GenerationResult, generate_text
from gateway.openai_api import sse_response
from gateway.sampling import SamplingFields, build_sampling, check_token_ids, stop_list
from gateway.schemas import GenerateRequest
from gateway.state import GatewayState, gateway_state

router = APIRouter()

_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
                  "ignore_eos", "skip_special_tokens", "seed", "sampling_seed"}


@router.get("/health")
async def health(state: GatewayState = Depends(gateway_state)):
    """200 when at least one prefill and one decode worker answer their health check, else 503."""
    if state.pool.is_ready:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable", "workers": _worker_states(state)}, status_code=503)


@router.post("/generate")
async def generate(body: GenerateRequest, state: GatewayState = Depends(gateway_state)):
    limits = state.pool.limits()
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("exactly one of `text` and `input_ids` is required", "text")
    if body.text is not None:
        prompt_ids = state.tokenizer.encode(body.text)
    else:
        prompt_ids = list(body.input_ids)
        check_token_ids(prompt_ids, limits, "input_ids")
    params = body.sampling_params
    unknown = sorted(set(params) - _SAMPLING_KEYS)
    if unknown:
        raise bad_request(f"unsupported sampling_params: {', '.join(unknown)}", f"sampling_params.{unknown[0]}")
    fields = SamplingFields(
        temperature=params.get("temperature"), top_p=params.get("top_p"), top_k=params.get("top_k"),
        min_p=params.get("min_p"), seed=params.get("seed", params.get("sampling_seed")),
        max_new_tokens=params.get("max_new_tokens", state.config.default_max_new_tokens),
        stop_token_ids=tuple(params.get("stop_token_ids") or ()), ignore_eos=bool(params.get("ignore_eos", False)))
    sampling = build_sampling(fields, len(prompt_ids), limits, state.config.sampling_defaults,
                              "sampling_params.max_new_tokens")
    request = GenerationRequest(prompt_ids, sampling, stop_list(params.get("stop")),
                                bool(params.get("skip_special_tokens", True)),
                                **({"request_id": body.rid} if body.rid else {}))
    started = time.perf_counter()
    if body.stream:
        return sse_response(_stream(state, request, started))
    result = GenerationResult()
    async for delta in generate_text(state.pool, state.config, state.tokenizer, request):
        result.add(delta)
    return _response(request, result, started)


async def _stream(state: GatewayState, request: GenerationRequest, started: float) -> AsyncIterator[dict]:
    """Each event carries the cumulative text so far, as SGLang's stream does."""
    result = GenerationResult()
    async for delta in generate_text(state.pool, state.config, state.tokenizer, request):
        result.add(delta)
        if delta.text or delta.finish is not None:
            yield _response(request, result, started)


def _response(request: GenerationRequest, result: GenerationResult, started: float) -> dict:
    meta = {"id": request.request_id, "finish_reason": _finish_reason(result.finish, len(result.output_ids)),
            "prompt_tokens": len(request.prompt_ids), "completion_tokens": len(result.output_ids),
            "cached_tokens": result.timings.cached_tokens if result.timings else 0,
            "e2e_latency": time.perf_counter() - started}
    return {"text": result.text, "output_ids": list(result.output_ids), "meta_info": meta}


def _finish_reason(finish: Finish | None, num_tokens: int) -> dict | None:
    if finish is None:
        return None
    if finish.reason == "length":
        return {"type": "length", "length": num_tokens}
    if finish.reason == "stop":
        return {"type": "stop", "matched": finish.matched}
    return {"type": "abort", "message": finish.message}


def _worker_states(state: GatewayState) -> list[dict]:
    return [{"role": w.role, "address": w.address, "ready": w.is_ready} for w in state.pool.all_workers()]
