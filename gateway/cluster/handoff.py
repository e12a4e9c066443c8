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
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import replace

from gateway.cluster.client import DecodeStream
from gateway.cluster.pool import Worker, WorkerPool
from gateway.cluster.worker_errors import WorkerError
from gateway.cluster.worker_records import DecodeChunk, KvTarget, PrefillResult, Reservation
from gateway.config import GatewayConfig
from gateway.errors import WORKER_RETRY_AFTER_S, APIError
from gateway.metrics import GatewayMetrics
from gateway.records import FinishReason, HandoffTimings, SamplingOptions, TokenEvent
from tandem.request_log import bind_request_id

logger = logging.getLogger(__name__)

_ABORT_TIMEOUT_S = 2.0
_SETTLE_TIMEOUT_S = 10.0  # a running KV write finishes within this (or the decode pages rest for the grace)


async def run_handoff(
    pool: WorkerPool,
    config: GatewayConfig,
    metrics: GatewayMetrics,
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingOptions,
    prompt_logprob_start: int | None = None,
    arrived_at: float | None = None,
) -> AsyncGenerator[TokenEvent, None]:
    """Yield the first token (with timings, and the prompt's logprobs from `prompt_logprob_start` when
    set), then the decode server's tokens until a finish. `arrived_at` (time.perf_counter()) is when
    the HTTP request arrived. Records the trip's latencies, phases and outcome in `metrics`."""
    bind_request_id(request_id)
    started = last = time.perf_counter()
    outcome = "error"
    events = _trip(
        pool,
        config,
        request_id,
        prompt_ids,
        sampling,
        prompt_logprob_start,
        (started - arrived_at) * 1000 if arrived_at is not None else 0.0,
    )
    is_first = True
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                now = time.perf_counter()
                if is_first and event.timings is not None:  # the first event always carries the timings
                    metrics.observe_first_token(event.timings, len(prompt_ids))
                    is_first = False
                else:
                    if event.timings is not None and event.timings.decode_queue_ms is not None:
                        metrics.observe_decode_queue(event.timings.decode_queue_ms)
                    metrics.observe_tokens(len(event.tokens), now - last)
                last = now
                outcome = event.finish_reason or "closed"  # "closed" if the reader stops after this event
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


async def _trip(
    pool: WorkerPool,
    config: GatewayConfig,
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingOptions,
    prompt_logprob_start: int | None,
    gateway_queue_ms: float,
) -> AsyncGenerator[TokenEvent, None]:
    """The trip itself, as `run_handoff` describes it, without the metrics."""
    started = time.perf_counter()
    prefill, decode, reservation = await _reserve(pool, config, request_id, len(prompt_ids))
    reserve_ms = (time.perf_counter() - started) * 1000
    stream: DecodeStream | None = None
    finished = False
    write_settled = False  # True once the prefill server has answered: no KV write can be in flight
    try:
        first = await _prefill(
            prefill,
            prefill.client.prefill(
                request_id,
                prompt_ids,
                sampling,
                reservation.kv_target,
                prompt_logprob_start,
                timeout_s=config.prefill_timeout_s,
            ),
            config.stall_timeout_s,
        )
        write_settled = True
        timings = HandoffTimings(
            reserve_ms,
            first.queue_ms,
            first.compute_ms,
            first.transfer_ms,
            first.kv_bytes,
            (time.perf_counter() - started) * 1000,
            first.cached_tokens,
            gateway_queue_ms,
        )
        yield TokenEvent([first.first_token], timings=timings, prompt_logprobs=list(first.prompt_logprobs))
        stream = decode.client.generate(
            request_id,
            prompt_ids,
            first.first_token,
            sampling,
            first.weights_id,
            reservation.kv_target.grant,
            timeout_s=config.request_timeout_s,
        )
        async for chunk in _stream(decode, stream, config.stall_timeout_s):
            finished = chunk.finish_reason is not None
            yield _event(chunk, timings)
            if finished:
                return
        logger.warning("decode worker %s ended the stream without a finish reason", decode.address)
        raise APIError(502, "the decode worker ended the stream without a finish reason", "internal_error")
    except _PrefillAnswered as answered:
        write_settled = True
        raise answered.error from None
    finally:
        if not finished:
            if stream is not None:
                stream.cancel()
            await _settle(_release(decode, prefill, request_id, None if write_settled else reservation.kv_target))
        pool.admission.released()


async def _reserve(
    pool: WorkerPool, config: GatewayConfig, request_id: str, prompt_len: int
) -> tuple[Worker, Worker, Reservation]:
    """A ready (prefill, decode) pair and the decode worker's reservation, once admission lets the
    trip through (it waits its turn while the decode pool is full). A trip cancelled meanwhile
    releases the reservation it may have made (no prefill was sent for it)."""
    pair: list[Worker] = []  # (prefill, decode) of the Reserve under way

    async def reserve() -> Reservation:
        pair[:] = pool.pick_pair()
        try:
            return await pair[1].client.reserve(request_id, prompt_len, timeout_s=config.reserve_timeout_s)
        except APIError:
            pair.clear()
            raise

    try:
        reservation = await pool.admission.admit(reserve)
    except asyncio.CancelledError:
        if pair:
            await _settle(_release(pair[1], pair[0], request_id, None))
        raise
    prefill, decode = pair
    return prefill, decode, reservation


def _event(chunk: DecodeChunk, timings: HandoffTimings) -> TokenEvent:
    """A decode chunk as the trip's event; the first one carries the timings again, now with the decode queue."""
    return TokenEvent(
        chunk.tokens,
        chunk.finish_reason,
        chunk.matched_token_id,
        chunk.message,
        replace(timings, decode_queue_ms=chunk.queue_ms) if chunk.queue_ms is not None else None,
    )


class _PrefillAnswered(Exception):
    """The prefill server answered with an error: its KV write, if any, is over."""

    def __init__(self, error: APIError) -> None:
        self.error = error


async def _prefill(worker: Worker, call: Awaitable[PrefillResult], stall_timeout_s: float) -> PrefillResult:
    """The prefill's answer. A failure the worker itself answered is raised as `_PrefillAnswered`;
    one the client side raised (deadline, cancel, lost connection, a stall) as is: the write may
    still be running then."""
    try:
        return await _unless_stalled(worker, call, stall_timeout_s)
    except WorkerError as exc:
        if not exc.is_settled:
            raise
        raise _PrefillAnswered(exc) from None


async def _stream(worker: Worker, stream: DecodeStream, stall_timeout_s: float) -> AsyncGenerator[DecodeChunk, None]:
    while (chunk := await _unless_stalled(worker, stream.read(), stall_timeout_s)) is not None:
        yield chunk


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
                logger.warning(
                    "%s worker %s sent nothing for %g s and does not answer health checks",
                    worker.role,
                    worker.address,
                    stall_timeout_s,
                )
                raise APIError(
                    503,
                    f"the {worker.role} worker stopped responding (nothing for {stall_timeout_s:g} s)",
                    "service_unavailable",
                    code="worker_stalled",
                    retry_after_s=WORKER_RETRY_AFTER_S,
                )
    finally:
        pending.cancel()


async def _release(decode: Worker, prefill: Worker, request_id: str, unsettled: KvTarget | None) -> None:
    """Free the decode server's pages for an unfinished trip. `unsettled` is the KV target of a
    Prefill that has not answered: the prefill server is asked to stop it and confirm its write is
    over, so the decode server frees the pages at once; if it cannot confirm, they rest for the
    write grace instead. (Cancelling a Generate stream frees them too; the Abort makes it certain.)"""
    write_settled = unsettled is None
    if unsettled is not None:
        with contextlib.suppress(WorkerError):
            await prefill.client.cancel_prefill(request_id, unsettled, timeout_s=_SETTLE_TIMEOUT_S)
            write_settled = True
        if not write_settled:
            logger.warning(
                "prefill worker %s did not confirm that %s's KV write is over; its decode pages "
                "rest for the write grace",
                prefill.address,
                request_id,
            )
    with contextlib.suppress(WorkerError):
        await decode.client.abort(request_id, write_settled, timeout_s=_ABORT_TIMEOUT_S)


_releasing: set[asyncio.Task] = set()  # strong references: a shielded release outlives its cancelled trip


async def _settle(release) -> None:
    """Run a release to its end even if the trip that started it is cancelled again meanwhile."""
    task = asyncio.ensure_future(release)
    _releasing.add(task)
    task.add_done_callback(_releasing.discard)
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(task)
