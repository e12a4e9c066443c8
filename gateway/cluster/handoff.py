"""One request's trip through the workers: Reserve (decode) -> Prefill -> Generate (decode).

The gateway only moves token ids and small control messages; the KV goes prefill -> decode
directly. Whatever ends the trip early (an error, a stop string, a client that went away), the
`finally` block tells the decode server, so no page stays held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import AsyncIterator

import grpc

from gateway.config import GatewayConfig
from gateway.errors import WORKER_RETRY_AFTER_S, APIError
from gateway.cluster.pool import Worker, WorkerPool
from gateway.metrics import GatewayMetrics
from gateway.records import FinishReason, GeneratedToken, HandoffTimings, TokenEvent
from tandem.request_log import bind_request_id
from tandem.v1 import common_pb2, decode_pb2, prefill_pb2

logger = logging.getLogger(__name__)

_FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: FinishReason.STOP, common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
                   common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT}
_ABORT_TIMEOUT_S = 2.0
_SETTLE_TIMEOUT_S = 10.0   # a running KV write finishes within this (or the decode pages rest for the grace)


async def run_handoff(pool: WorkerPool, config: GatewayConfig, metrics: GatewayMetrics, request_id: str,
                      prompt_ids: list[int],                       sampling: common_pb2.SamplingParams, prompt_logprob_start: int | None = None,
                      arrived_at: float | None = None) -> AsyncIterator[TokenEvent]:
    """Yield the first token (with timings, and the prompt's logprobs from `prompt_logprob_start` when
    set), then the decode server's tokens until a finish. `arrived_at` (time.perf_counter()) is when
    the HTTP request arrived. Records the trip's latencies, phases and outcome in `metrics`."""
    bind_request_id(request_id)
    started = last = time.perf_counter()
    outcome = "error"
    events = _trip(pool, config, request_id, prompt_ids, sampling, prompt_logprob_start,
                   (started - arrived_at) * 1000 if arrived_at is not None else 0.0)
    is_first = True
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                now = time.perf_counter()
                if is_first:
                    metrics.observe_first_token(event.timings, len(prompt_ids))
                    is_first = False
                else:
                    if event.timings is not None and event.timings.decode_queue_ms is not None:
                        metrics.observe_decode_queue(event.timings.decode_queue_ms)
                    metrics.observe_tokens(len(event.tokens), now - last)
                last = now
                outcome = event.finish_reason or "closed"   # "closed" if the reader stops after this event
                yield event
    except (GeneratorExit, asyncio.CancelledError):
        if outcome not in tuple(FinishReason):
            outcome = "closed"
        raise
    except BaseException:
        outcome = "error"
        raise
    finally:
        metrics.observe_end(outcome, time.perf_counter() - started)


def _token(msg: common_pb2.TokenOutput) -> GeneratedToken:
    return GeneratedToken(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top_logprobs),
                          tuple((t.token_id, t.logprob) for t in msg.token_ids_logprobs))


async def _trip(pool: WorkerPool, config: GatewayConfig, request_id: str, prompt_ids: list[int],
                sampling: common_pb2.SamplingParams, prompt_logprob_start: int | None,
                gateway_queue_ms: float) -> AsyncIterator[TokenEvent]:
    """The trip itself, as `run_handoff` describes it, without the metrics."""
    started = time.perf_counter()
    pair: list[Worker] = []   # (prefill, decode) of the Reserve under way, then of the trip

    async def reserve() -> decode_pb2.ReserveResponse:
        pair[:] = pool.pick_pair()
        try:
            return await _call(pair[1], pair[1].stub.Reserve(
                decode_pb2.ReserveRequest(request_id=request_id, prompt_len=len(prompt_ids)),
                timeout=config.reserve_timeout_s))
        except APIError:
            pair.clear()
            raise

    try:
        reserved = await pool.admission.admit(reserve)   # waits its turn while the decode pool is full
    except asyncio.CancelledError:   # a reservation may have been made: no prefill was sent for it
        if pair:
            await _settle(_release(pair[1], pair[0], request_id, None))
        raise
    prefill, decode = pair
    reserve_ms = (time.perf_counter() - started) * 1000
    generate: grpc.aio.UnaryStreamCall | None = None
    finished = False
    write_settled = False   # True once the prefill server has answered: no KV write can be in flight
    try:
        prefill_request = prefill_pb2.PrefillRequest(request_id=request_id, token_ids=prompt_ids,
                                                     sampling_params=sampling, kv_target=reserved.kv_target)
        if prompt_logprob_start is not None:
            prefill_request.logprob_start_len = prompt_logprob_start
        first = await _prefill(prefill, prefill.stub.Prefill(prefill_request, timeout=config.prefill_timeout_s),
                               config.stall_timeout_s)
        write_settled = True
        timings = HandoffTimings(reserve_ms, first.queue_ms, first.compute_ms, first.transfer_ms, first.kv_bytes,
                                 (time.perf_counter() - started) * 1000, first.cached_tokens, gateway_queue_ms)
        yield TokenEvent([_token(first.first_token)], timings=timings,
                         prompt_logprobs=[_token(t) for t in first.prompt_logprobs])
        generate = decode.stub.Generate(
            decode_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                       first_token=first.first_token, sampling_params=sampling,
                                       weights_id=first.weights_id,
                                       kv_grant=reserved.kv_target.grant),
            timeout=config.request_timeout_s)
        async for message in _stream(decode, generate, config.stall_timeout_s):
            reason = _FINISH_REASONS.get(message.finish_reason)
            finished = reason is not None
            yield TokenEvent([_token(t) for t in message.tokens], reason,
                             message.matched_token_id if message.HasField("matched_token_id") else None,
                             message.message,
                             replace(timings, decode_queue_ms=message.queue_ms)
                             if message.HasField("queue_ms") else None)
            if finished:
                return
        logger.warning("decode worker %s ended the stream without a finish reason", decode.address)
        raise APIError(502, "the decode worker ended the stream without a finish reason", "internal_error")
    except _PrefillAnswered as answered:
        write_settled = True
        raise answered.error from None
    finally:
        if not finished:
            if generate is not None:
                generate.cancel()
            await _settle(_release(decode, prefill, request_id, None if write_settled else reserved.kv_target))
        pool.admission.released()


async def _call(worker: Worker, call):
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise APIError.from_grpc(exc, worker.role, worker.address) from None


class _PrefillAnswered(Exception):
    """The prefill server answered with an error: its KV write, if any, is over."""

    def __init__(self, error: APIError) -> None:
        self.error = error


# Codes the client side can raise on its own (deadline, cancel, lost connection): the server's
# write may still be running then.
_UNSETTLED_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                              grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN})


async def _prefill(worker: Worker, call, stall_timeout_s: float):
    try:
        return await _unless_stalled(worker, call, stall_timeout_s)
    except grpc.aio.AioRpcError as exc:
        error = APIError.from_grpc(exc, worker.role, worker.address)
        if exc.code() in _UNSETTLED_CODES:
            raise error from None
        raise _PrefillAnswered(error) from None


async def _stream(worker: Worker, call: grpc.aio.UnaryStreamCall, stall_timeout_s: float
                  ) -> AsyncIterator[decode_pb2.GenerateResponse]:
    try:
        while (message := await _unless_stalled(worker, call.read(), stall_timeout_s)) is not grpc.aio.EOF:
            yield message
    except grpc.aio.AioRpcError as exc:
        raise APIError.from_grpc(exc, worker.role, worker.address) from None


async def _unless_stalled(worker: Worker, awaitable, stall_timeout_s: float):
    """Await a call's answer; each time `stall_timeout_s` passes without one, check that the worker
    still answers health checks. A worker that does not (frozen, wedged, its host gone) ends the
    wait with a 503 and is marked unready; a slow but live one (a long prompt, a queue) is waited for."""
    pending = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait((pending,), timeout=stall_timeout_s)
            if done:
                return pending.result()
            if not await worker.responds():
                logger.warning("%s worker %s sent nothing for %g s and does not answer health checks",
                               worker.role, worker.address, stall_timeout_s)
                raise APIError(503, f"the {worker.role} worker stopped responding (nothing for "
                                    f"{stall_timeout_s:g} s)", "service_unavailable", code="worker_stalled",
                               retry_after_s=WORKER_RETRY_AFTER_S)
    finally:
        pending.cancel()


async def _release(decode: Worker, prefill: Worker, request_id: str, unsettled: common_pb2.KvTarget | None
                   ) -> None:
    """Free the decode server's pages for an unfinished trip. `unsettled` is the KV target of a
    Prefill that has not answered: the prefill server is asked to stop it and confirm its write is
    over, so the decode server frees the pages at once; if it cannot confirm, they rest for the
    write grace instead. (Cancelling a Generate stream frees them too; the Abort makes it certain.)"""
    write_settled = unsettled is None
    if unsettled is not None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await prefill.stub.CancelPrefill(prefill_pb2.CancelPrefillRequest(request_id=request_id,
                                                                              kv_target=unsettled),
                                             timeout=_SETTLE_TIMEOUT_S)
            write_settled = True
        if not write_settled:
            logger.warning("prefill worker %s did not confirm that %s's KV write is over; its decode pages "
                           "rest for the write grace", prefill.address, request_id)
    with contextlib.suppress(grpc.aio.AioRpcError):
        await decode.control.Abort(common_pb2.AbortRequest(request_id=request_id, kv_write_settled=write_settled),
                                   timeout=_ABORT_TIMEOUT_S)


_releasing: set[asyncio.Task] = set()   # strong references: a shielded release outlives its cancelled trip


async def _settle(release) -> None:
    """Run a release to its end even if the trip that started it is cancelled again meanwhile."""
    task = asyncio.ensure_future(release)
    _releasing.add(task)
    task.add_done_callback(_releasing.discard)
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(task)
