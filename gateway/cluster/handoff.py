"""One request's trip through the workers (`gateway/cluster/trip.py`), with its metrics and failover.

Failover: if a worker fails (unreachable, refused, reset, draining, stalled) before the request has
produced a token, the trip is run once more on other workers: the failed attempt has already given
back everything it held, and the new one is routed afresh without the failed worker. After the first
token, a failure ends the request (the HTTP routes end a stream with an error event and
`data: [DONE]`; the gRPC API with an error status). Both fronts call `run_handoff`, so both get it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator

from gateway.caller import current_caller
from gateway.cluster.pool import WorkerPool
from gateway.cluster.trip import TripRequest, run_trip
from gateway.cluster.worker_errors import WorkerError
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.records import FinishReason, TokenChunk
from tandem import tracing
from tandem.request_log import bind_request_id
from tandem.sampling import SamplingSpec

logger = logging.getLogger(__name__)

_MAX_ATTEMPTS = 2  # the first, and one retry on other workers


async def run_handoff(
    pool: WorkerPool,
    config: GatewayConfig,
    metrics: GatewayMetrics,
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingSpec,
    prompt_logprob_start: int | None = None,
    arrived_at: float | None = None,
    priority: int = 0,
    lora_name: str = "",
) -> AsyncGenerator[TokenChunk, None]:
    """Yield the first token (with timings, and the prompt's logprobs from `prompt_logprob_start` when
    set), then the decode server's tokens until a finish. `arrived_at` (time.perf_counter()) is when
    the HTTP request arrived. `priority` (lower first), ranked for the bound caller (a batch line's
    below every interactive request's), and the caller's tenant order the admission queue and the
    workers' queues (`TripRequest`); `lora_name` is the adapter it runs under ("" the base model).
    Records the trip's latencies, phases and outcome in `metrics`."""
    bind_request_id(request_id)
    started = last = time.perf_counter()
    outcome = "error"
    gateway_queue_ms = (started - arrived_at) * 1000 if arrived_at is not None else 0.0
    trace = tracing.current()  # the front's request span, when traced: each trip's spans go under it
    if arrived_at is not None:
        tracing.record_span("gateway_queue", trace, arrived_at, started)
    caller = current_caller()
    request = TripRequest(
        request_id,
        prompt_ids,
        sampling,
        prompt_logprob_start,
        gateway_queue_ms,
        caller.rank(priority),
        caller.tenant,
        lora_name,
        trace=trace,
    )
    events = _with_failover(pool, config, metrics, request)
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
                outcome = event.finish.reason if event.finish else "closed"  # "closed" if the reader stops here
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


async def _with_failover(
    pool: WorkerPool, config: GatewayConfig, metrics: GatewayMetrics, request: TripRequest
) -> AsyncGenerator[TokenChunk, None]:
    """The trip's events; when a worker fails before the first of them, the trip once more on workers
    other than the failed one, if there are any that may be paired."""
    avoid: frozenset[str] = frozenset()
    for attempt in range(1, _MAX_ATTEMPTS + 1):
        has_output = False
        trip = run_trip(pool, config, metrics, request, avoid)
        try:
            async with contextlib.aclosing(trip):
                async for event in trip:
                    has_output = True
                    yield event
            return
        except WorkerError as exc:
            retry_avoid = avoid | {exc.address}
            is_final = has_output or not exc.is_worker_failure or attempt == _MAX_ATTEMPTS
            if is_final or not pool.can_route(retry_avoid, request.lora_name):
                raise
            logger.warning(
                "worker %s failed before the first token (%s); trying other workers", exc.address, exc.detail
            )
            metrics.failovers.inc()
            avoid = retry_avoid
