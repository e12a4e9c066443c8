"""DecodeService: reserve pages for a handoff (sharing the prompt's prefix this worker already holds in
its prefix cache; the engine holds them as a receiving request and its KV connector,
server_runtime/kv_receive.py, keeps the deadline), then confirm it with the first token and decode it
in the continuous batch; or,
for prefill on decode, prefill the prompt here through the engine's own prefill (the path a preempted
request takes to be recomputed) and decode it in the same batch, with no KV transfer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from engine.errors import EngineError
from engine.kv_connector import ReceivedKV
from engine.request import FinishReason, Request, SamplingParams, StepOutput
from server_runtime.common_rpcs import add_worker_servicer
from server_runtime.context import WorkerContext
from server_runtime.convert import finish_to_proto, layout_to_proto, sampling_from_proto, token_to_proto
from server_runtime.errors import RequestFailedError, abort_with
from server_runtime.kv_grants import GrantError, IssuedGrants, grant_key
from server_runtime.lora_serving import HeldLora, held_lora
from server_runtime.spans import record_decode, record_local_prefill
from server_runtime.worker import WorkerKind, start_engine_worker
from tandem import tracing
from tandem.request_log import bind_request_id
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.grants = IssuedGrants(grant_key(ctx.config.kv_grant_secret))
        assert ctx.receiver is not None, "a decode worker's engine takes KV in through a KVReceiveConnector"
        self.receiver = ctx.receiver

    async def Reserve(
        self, request: decode_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.ReserveResponse:
        bind_request_id(request.request_id)
        if self.ctx.is_draining:  # a gateway that has not seen NOT_SERVING yet; it may retry elsewhere
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode worker is shutting down")
        ttl_s = self.ctx.config.reservation_ttl_s  # the engine's KV connector keeps the pages as long
        try:
            reserved = await self.ctx.loop.reserve(
                request.request_id,
                request.prompt_len,
                request.priority,
                list(request.prompt_token_ids) or None,
                self._cache_namespace(request.lora_name),
            )
        except EngineError as exc:
            await abort_with(context, exc)
        except asyncio.CancelledError:  # the caller went away; its reservation, if made, was never granted
            await asyncio.shield(self.ctx.loop.abort(request.request_id, "the caller went away", write_settled=True))
            raise
        facts = self.ctx.facts
        target = common_pb2.KvTarget(
            session_id=self.ctx.transport.session_id,
            base_addr=facts.pool_base_addr,
            layout=layout_to_proto(facts.layout),
            page_ids=reserved.page_ids,
            skip_tokens=reserved.cached_tokens,
        )
        self.grants.issue(request.request_id, target, ttl_s)
        self.ctx.loop.metrics.record_reserve(request.prompt_len, reserved.cached_tokens)
        return decode_pb2.ReserveResponse(
            request_id=request.request_id,
            kv_target=target,
            ttl_ms=int(ttl_s * 1000),
            cached_tokens=reserved.cached_tokens,
        )

    def _cache_namespace(self, lora_name: str) -> str | None:
        """Where a prompt under adapter `lora_name` is cached ("" the base model; None: an adapter
        not loaded here, whose Generate will fail: nothing is matched for it)."""
        if not lora_name:
            return ""
        return self.ctx.loras.cache_namespace(lora_name) if self.ctx.loras is not None else None

    async def Generate(self, request: decode_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        bind_request_id(rid)
        try:  # before anything else: a Generate without the grant must not touch the reservation
            self.grants.redeem(rid, request.kv_grant)
        except GrantError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        received = time.perf_counter()
        trace, admitted, num_tokens = tracing.caller_context(context.invocation_metadata()), None, 0
        finished = False
        async with contextlib.AsyncExitStack() as held:  # the adapter is let go after the finally's abort
            try:
                try:
                    sampling = sampling_from_proto(request.sampling_params)
                    if sampling.grammar is not None:  # compile off the engine thread (see GrammarBackend)
                        # a slow compile must not let the reservation expire
                        await self.ctx.loop.call(lambda engine: self.receiver.keep(rid))
                        await self.ctx.loop.prepare_grammar(sampling.grammar, self.ctx.config.grammar_compile_timeout_s)
                    lora = await held.enter_async_context(held_lora(self.ctx.loras, request.lora_name, self.ctx.loop))
                    first = request.first_token
                    confirmed = ReceivedKV(first.token_id, first.logprob, request.weights_id)
                    sink = await self.ctx.loop.submit(_request(rid, request, sampling, lora, confirmed))
                except EngineError as exc:
                    await abort_with(context, exc)  # the finally below drops the reservation
                admitted = time.perf_counter()
                first = decode_pb2.GenerateResponse(queue_ms=(admitted - received) * 1000)
                async for response in _stream(rid, sink, context, first):
                    finished = response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                    num_tokens += len(response.tokens)
                    yield response
            finally:
                record_decode(trace, received, admitted, time.perf_counter(), num_tokens)
                if not finished:  # rejected, or the client went away: free the request's pages now
                    # Generate comes after the prefill answered, so its KV write has settled.
                    await asyncio.shield(self.ctx.loop.abort(rid, "client cancelled", write_settled=True))

    async def PrefillAndGenerate(
        self, request: decode_pb2.PrefillAndGenerateRequest, context: grpc.aio.ServicerContext
    ):
        """Prefill the prompt on this worker and stream every token; the first message carries the
        prompt's queue and compute times."""
        rid = request.request_id
        bind_request_id(rid)
        if self.ctx.is_draining:  # a gateway that has not seen NOT_SERVING yet; it may retry elsewhere
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode worker is shutting down")
        received = time.perf_counter()
        finished = False
        async with contextlib.AsyncExitStack() as held:  # the adapter is let go after the finally's abort
            try:
                try:
                    sampling = sampling_from_proto(request.sampling_params)
                    if sampling.grammar is not None:  # compile off the engine thread (see GrammarBackend)
                        await self.ctx.loop.prepare_grammar(sampling.grammar, self.ctx.config.grammar_compile_timeout_s)
                    lora = await held.enter_async_context(held_lora(self.ctx.loras, request.lora_name, self.ctx.loop))
                    sink = await self.ctx.loop.submit(_request(rid, request, sampling, lora))
                except EngineError as exc:
                    await abort_with(context, exc)
                trace = tracing.caller_context(context.invocation_metadata())
                async for response in _stream(rid, sink, context, None, received):
                    finished = response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                    if trace is not None:  # the first message carries the prompt's queue and compute times
                        times = (response.queue_ms, response.prefill_compute_ms)
                        record_local_prefill(
                            trace, received, *times, len(request.prompt_token_ids), response.cached_tokens
                        )
                        trace = None
                    yield response
            finally:
                if not finished:  # rejected, or the client went away: free the request's pages now
                    await asyncio.shield(self.ctx.loop.abort(rid, "client cancelled", write_settled=True))


def _request(
    rid: str,
    request: decode_pb2.GenerateRequest | decode_pb2.PrefillAndGenerateRequest,
    sampling: SamplingParams,
    lora: HeldLora | None,
    received: ReceivedKV | None = None,
) -> Request:
    """The engine request of a Generate (confirming its reservation: `received`) or a PrefillAndGenerate."""
    return Request(
        rid,
        list(request.prompt_token_ids),
        sampling,
        priority=request.priority,
        lora_id=lora.lora_id if lora else "",
        lora_slot=lora.slot_id if lora else None,
        kv_params=received,
    )


async def _stream(
    rid: str,
    sink: asyncio.Queue,
    context: grpc.aio.ServicerContext,
    first: decode_pb2.GenerateResponse | None,
    received: float | None = None,
) -> AsyncIterator[decode_pb2.GenerateResponse]:
    """The request's outputs as messages, until its finish; `first`'s fields go into the first
    message. For a prompt prefilled here (`received`: when the call arrived) the first message
    carries its queue and compute times, from the first output (its first token)."""
    finished = False
    while not finished:
        outputs = [await sink.get()]
        while not sink.empty():
            outputs.append(sink.get_nowait())
        finished = outputs[-1].finish_reason is not None
        # A failed request (its pages already freed): the tokens before it, then the error as the status.
        failure = outputs.pop() if outputs[-1].finish_reason is FinishReason.ERROR else None
        if outputs:
            response = _response(rid, outputs)
            if first is None and received is not None:
                first = _prefill_times(outputs[0], received)
            if first is not None:
                response.MergeFrom(first)
                first = None
            received = None
            yield response
        if failure is not None:
            await abort_with(context, RequestFailedError(failure.abort_message))


def _prefill_times(output: StepOutput, received: float) -> decode_pb2.GenerateResponse:
    """The queue and compute times of a prompt prefilled here, from its first output."""
    started = output.prefill_started_at or received
    computed = time.perf_counter()
    return decode_pb2.GenerateResponse(
        queue_ms=(started - received) * 1000,
        prefill_compute_ms=(computed - started) * 1000,
        cached_tokens=output.cached_tokens,
    )


def _response(rid: str, outputs: list[StepOutput]) -> decode_pb2.GenerateResponse:
    last = outputs[-1]
    response = decode_pb2.GenerateResponse(
        request_id=rid,
        tokens=[token_to_proto(o) for o in outputs if o.token_id is not None],
        finish_reason=finish_to_proto(last.finish_reason),
        message=last.abort_message,
        spec_verify_ct=last.spec_verify_ct,
        spec_accepted_tokens=last.spec_accepted_tokens,
    )
    if last.matched_token_id is not None:
        response.matched_token_id = last.matched_token_id
    return response


def add_decode_servicer(server: grpc.aio.Server, ctx: WorkerContext) -> str:
    """Register DecodeService; returns the service's full name."""
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(ctx), server)
    return decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name


DECODE = WorkerKind("decode", start_engine_worker, (add_decode_servicer, add_worker_servicer))
