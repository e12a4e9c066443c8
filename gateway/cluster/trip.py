"""One attempt at a request's trip through the workers, on the route the pool gives it.

Disaggregated: Reserve (decode) -> Prefill -> Generate (decode); the gateway only moves token ids and
small control messages, the KV goes prefill -> decode directly. Local (the router's conditional
disaggregation): PrefillAndGenerate on the decode worker alone, no KV transfer. Whatever ends a trip
early (an error, a stop string, a client that went away), the `finally` blocks tell the workers, so no
page stays held, take the request off its workers' in-flight counts and wake the admission queue. A
call that fails because of its worker (`WorkerError.is_worker_failure`) marks that worker
(`Worker.record_failure`; `worker_calls.unless_stalled`); whether to try again elsewhere is the
caller's choice (`gateway/cluster/handoff.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace

from gateway.cluster.client import DecodeStream
from gateway.cluster.pool import WorkerPool
from gateway.cluster.prefix_index import PromptPages
from gateway.cluster.routing import Route
from gateway.cluster.trip_trace import TripTrace
from gateway.cluster.worker import Worker
from gateway.cluster.worker_calls import PrefillAnswered, abort, chunks, prefill_answer, release, settle, unless_stalled
from gateway.cluster.worker_records import Reservation
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.records import HandoffTimings, PrefillPath, TokenChunk
from tandem import tracing
from tandem.sampling import SamplingSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TripRequest:
    """What a trip carries: the prompt, its sampling, the prompt logprobs asked for (from
    `prompt_logprob_start`), the time it waited before the trip (`gateway_queue_ms`), its `priority`
    (lower is served first; on to the workers), its `tenant` (whom the admission queue is fair
    between; "" for all anonymous callers) and its `lora_name` (the adapter both legs run under; ""
    the base model). `pages` keeps the prompt's page hashes over every
    routing of the request."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    prompt_logprob_start: int | None = None
    gateway_queue_ms: float = 0.0
    priority: int = 0
    tenant: str = ""
    lora_name: str = ""
    trace: tracing.Context | None = field(default=None, repr=False, compare=False)  # the request span's, if traced
    pages: PromptPages = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pages", PromptPages(self.prompt_ids, self.lora_name))  # frozen: set once, here


async def run_trip(
    pool: WorkerPool, config: GatewayConfig, metrics: GatewayMetrics, request: TripRequest, avoid: frozenset[str]
) -> AsyncGenerator[TokenChunk, None]:
    """One attempt on workers whose addresses are not in `avoid`: the first token (with the timings),
    then the rest until a finish. Records the route in `metrics`. However it ends, the admission
    queue is woken once (`Admission.released`): the trip's pages are back."""
    started = time.perf_counter()
    # Prompt logprobs come from a prefill worker's scoring pass, so such a request is never prefilled locally.
    route = pool.route(request.pages, avoid, may_prefill_locally=request.prompt_logprob_start is None)
    trace = TripTrace(request.trace, started)
    trace.routed(route)
    if route.is_local:
        _observe(metrics, route)
        events = _local_trip(pool, config, route, request, started, trace)
    else:
        events = _disaggregated_trip(pool, config, metrics, route, request, started, avoid, trace)
    try:
        async with contextlib.aclosing(events):  # a reader that stops closes the trip now, not at collection
            async for event in events:
                trace.saw(event)
                yield event
    except BaseException as exc:
        trace.failed(exc)
        raise
    finally:
        route.end()
        pool.admission.released()


async def _disaggregated_trip(
    pool: WorkerPool,
    config: GatewayConfig,
    metrics: GatewayMetrics,
    first_route: Route,
    request: TripRequest,
    started: float,
    avoid: frozenset[str],
    trace: TripTrace,
) -> AsyncGenerator[TokenChunk, None]:
    route, reservation = await _reserve(pool, config, first_route, request, avoid)
    trace.reserved(route)
    prefill, decode = route.prefill, route.decode
    assert prefill is not None  # a disaggregated route has one
    reserve_ms = (time.perf_counter() - started) * 1000
    stream: DecodeStream | None = None
    finished = False
    write_settled = False  # True once the prefill server has answered: no KV write can be in flight
    rid = request.request_id
    try:
        _observe(metrics, route)
        pool.router.routed(route)  # only now: a route chosen on an admission retry and dropped is never sent
        pool.router.decode_matched(route, reservation.cached_tokens)
        call = prefill.client.prefill(
            rid,
            request.prompt_ids,
            request.sampling,
            reservation.kv_target,
            request.prompt_logprob_start,
            timeout_s=config.prefill_timeout_s,
            priority=request.priority,
            metadata=trace.prefill_metadata(route),
            lora_name=request.lora_name,
        )
        first = await prefill_answer(prefill, call, config.stall_timeout_s)
        write_settled = True
        trace.prefilled(first.cached_tokens, first.kv_bytes)
        route.end_prefill()
        pool.router.prefilled(route, first.cached_tokens)
        metrics.observe_cached(prefill.address, first.cached_tokens)
        timings = HandoffTimings(
            reserve_ms,
            first.queue_ms,
            first.compute_ms,
            first.transfer_ms,
            first.kv_bytes,
            (time.perf_counter() - started) * 1000,
            first.cached_tokens,
            request.gateway_queue_ms,
            decode_cached_tokens=reservation.cached_tokens,
        )
        output_ids = [first.first_token.token_id]
        yield TokenChunk([first.first_token], timings=timings, prompt_logprobs=list(first.prompt_logprobs))
        stream = decode.client.generate(
            rid,
            request.prompt_ids,
            first.first_token,
            request.sampling,
            first.weights_id,
            reservation.kv_target.grant,
            timeout_s=config.request_timeout_s,
            priority=request.priority,
            metadata=trace.decode_metadata(),
            lora_name=request.lora_name,
        )
        async for chunk in chunks(decode, stream, config.stall_timeout_s):
            finished = chunk.finish is not None
            output_ids.extend(chunk.token_ids)
            if finished:  # told before the last event: a reader may stop at it
                pool.router.finished(route, request.prompt_ids + output_ids, request.lora_name)
            yield _event(chunk, timings)
            if finished:
                return
        raise _no_finish(decode)
    except PrefillAnswered as answered:
        write_settled = True
        raise answered.error from None
    finally:
        route.end()
        if not finished:
            if stream is not None:
                stream.cancel()
            await settle(release(decode, prefill, rid, None if write_settled else reservation.kv_target))


async def _local_trip(
    pool: WorkerPool, config: GatewayConfig, route: Route, request: TripRequest, started: float, trace: TripTrace
) -> AsyncGenerator[TokenChunk, None]:
    """The decode worker prefills the prompt and streams every token. The first token comes alone in
    the first event, with the timings; cancelling the stream frees the request's pages on the worker.
    The router learns what the worker held of the prompt (its first chunk's `cached_tokens`) and, at
    the finish, the sequence it caches."""
    decode = route.decode
    pool.router.routed(route)
    stream = decode.client.prefill_and_generate(
        request.request_id,
        request.prompt_ids,
        request.sampling,
        timeout_s=config.request_timeout_s,
        priority=request.priority,
        metadata=trace.local_metadata(),
        lora_name=request.lora_name,
    )
    timings: HandoffTimings | None = None
    finished = False
    output_ids: list[int] = []
    try:
        async for chunk in chunks(decode, stream, config.stall_timeout_s):
            finished = chunk.finish is not None
            output_ids.extend(chunk.token_ids)
            if finished:  # told before the last event: a reader may stop at it
                pool.router.finished(route, request.prompt_ids + output_ids, request.lora_name)
            if timings is None:
                pool.router.decode_matched(route, chunk.cached_tokens)
                timings = HandoffTimings(
                    0.0,
                    chunk.queue_ms or 0.0,
                    chunk.prefill_compute_ms or 0.0,
                    0.0,
                    0,
                    (time.perf_counter() - started) * 1000,
                    chunk.cached_tokens,
                    request.gateway_queue_ms,
                    prefill_path=PrefillPath.LOCAL,
                    decode_cached_tokens=chunk.cached_tokens,
                )
                first = chunk.tokens[:1]
                rest = replace(chunk, tokens=chunk.tokens[1:], queue_ms=None) if len(chunk.tokens) > 1 else None
                head = TokenChunk(first) if rest is not None else replace(chunk, tokens=first)
                yield _event(head, timings, is_first=True)
                if rest is None:
                    if head.finish is not None:
                        return
                    continue
                chunk = rest
            yield _event(chunk, timings)
            if chunk.finish is not None:
                return
        raise _no_finish(decode)
    finally:
        if not finished:
            stream.cancel()
            await settle(abort(decode, request.request_id))


async def _reserve(
    pool: WorkerPool, config: GatewayConfig, first_route: Route, request: TripRequest, avoid: frozenset[str]
) -> tuple[Route, Reservation]:
    """The route and its decode worker's reservation, once admission lets the trip through (it waits
    its turn while the decode pool is full; each later try is routed afresh). A trip cancelled
    meanwhile releases the reservation it may have made (no prefill was sent for it)."""
    routes: list[Route] = [first_route]  # the route of the Reserve under way, if any
    rid = request.request_id

    async def reserve() -> Reservation:
        if not routes:
            routes.append(pool.route(request.pages, avoid, may_prefill_locally=False))
        route = routes[0]
        try:
            call = route.decode.client.reserve(
                rid,
                request.prompt_ids,
                timeout_s=config.reserve_timeout_s,
                priority=request.priority,
                lora_name=request.lora_name,
            )
            return await unless_stalled(route.decode, call, config.stall_timeout_s)
        except APIError:
            route.end()
            routes.clear()
            raise

    try:
        reservation = await pool.admission.admit(reserve, request.priority, request.tenant)
    except asyncio.CancelledError:
        if routes:
            routes[0].end()
            prefill = routes[0].prefill
            assert prefill is not None
            await settle(release(routes[0].decode, prefill, rid, None))
        raise
    return routes[0], reservation


def _observe(metrics: GatewayMetrics, route: Route) -> None:
    metrics.observe_route(
        route.policy.value,
        None if route.prefill is None else route.prefill.address,
        route.prefill_reason.value,
        route.decode.address,
        route.decode_reason.value,
        route.estimated_cached_tokens,
    )


def _event(chunk: TokenChunk, timings: HandoffTimings, is_first: bool = False) -> TokenChunk:
    """A decode worker's chunk as the trip hands it on: the first one carries the timings (again, for a
    Generate stream, now with the decode queue)."""
    if is_first:
        event_timings: HandoffTimings | None = timings
    elif chunk.queue_ms is not None:
        event_timings = replace(timings, decode_queue_ms=chunk.queue_ms)
    else:
        event_timings = None
    return replace(chunk, timings=event_timings)


def _no_finish(decode: Worker) -> APIError:
    logger.warning("decode worker %s ended the stream without a finish reason", decode.address)
    return APIError(502, "the decode worker ended the stream without a finish reason", "internal_error")
