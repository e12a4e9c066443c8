"""A worker's Prometheus metrics: one registry per process, served as text over HTTP (`--metrics-port`).

Who writes what (prometheus_client's values are thread-safe, so each writer updates them directly):

- the engine thread (`EngineLoop`): step time and batch size and tokens generated after each step,
  queue depths and KV pages every 0.25 s (on the engine thread's tick);
- `RpcMetricsInterceptor`, on the event loop: every `tandem.v1` RPC by method and final status code;
- the prefill servicer: prompt and cached tokens, KV bytes and transfer time of each request;
- the decode servicer: each handoff's prompt tokens and those its prefix cache already held.

Nothing here is logged: per-step numbers go to these metrics only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import start_http_server

from engine.stats import EngineStats

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_SERVICE_PREFIX = "/tandem."  # the worker's own RPCs; health checks and reflection are not counted


class WorkerMetrics:
    """Every metric of one worker process, in its own `registry` (never the global default one)."""

    def __init__(self, role: str, model_path: str = "", version: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Info("tandem_worker", "What this worker serves", registry=r).info(
            {"role": role, "model_path": model_path, "version": version}
        )
        self.requests = Counter(
            "tandem_worker_requests",
            "tandem.v1 RPCs answered, by method and gRPC status code",
            ["method", "code"],
            registry=r,
        )
        self.num_running = Gauge("tandem_worker_num_requests_running", "Requests in the running batch", registry=r)
        self.num_waiting = Gauge("tandem_worker_num_requests_waiting", "Requests queued for prefill", registry=r)
        self.num_loading = Gauge(
            "tandem_worker_num_requests_loading",
            "Of the waiting requests, those whose cached KV pages are being read from the disk tier or the store",
            registry=r,
        )
        self.num_sending = Gauge(
            "tandem_worker_num_kv_sends_running",
            "Prefill-only requests whose KV is being written to a decode worker",
            registry=r,
        )
        self.kv_pages = Gauge(
            "tandem_worker_kv_pages",
            "KV pages by state: used (held by requests or reservations), cached (kept only by the prefix cache), free",
            ["state"],
            registry=r,
        )
        self.torch_threads = Gauge(
            "tandem_worker_torch_threads",
            "Torch threads the engine's steps run on (a decode worker's follow the load)",
            registry=r,
        )
        self.kv_pages_capacity = Gauge("tandem_worker_kv_pages_capacity", "KV pages in the pool", registry=r)
        self.prompt_tokens = Counter("tandem_worker_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.cached_prompt_tokens = Counter(
            "tandem_worker_cached_prompt_tokens", "Prompt tokens whose KV came from the prefix cache", registry=r
        )
        self.prefix_cache_hit_rate = Gauge(
            "tandem_worker_prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens since start", registry=r
        )
        self.handoff_prompt_tokens = Counter(
            "tandem_worker_handoff_prompt_tokens",
            "Prompt tokens of the handoffs this decode worker reserved",
            registry=r,
        )
        self.handoff_cached_tokens = Counter(
            "tandem_worker_handoff_cached_tokens",
            "Of those, the tokens whose KV this decode worker already held in its prefix cache (not sent)",
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "tandem_worker_kv_transfer_bytes", "KV bytes written to decode servers", registry=r
        )
        self.kv_transfer_seconds = Histogram(
            "tandem_worker_kv_transfer_seconds",
            "Time of one request's KV write",
            buckets=_TRANSFER_BUCKETS_S,
            registry=r,
        )
        self.step_seconds = Histogram(
            "tandem_worker_step_seconds",
            "Time of one engine step (its count: the steps)",
            buckets=_STEP_BUCKETS_S,
            registry=r,
        )
        self.step_batch_size = Histogram(
            "tandem_worker_step_batch_size",
            "Requests with an output in one engine step",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.generation_tokens = Counter(
            "tandem_worker_generation_tokens", "Tokens sampled by this worker's engine", registry=r
        )
        self.overlapped_steps = Counter(
            "tandem_worker_overlapped_steps",
            "Engine steps queued while the step before them computed (--disable-overlap-schedule: none)",
            registry=r,
        )
        self.preemptions = Gauge(
            "tandem_worker_preemptions",
            "Running requests paused for lack of KV pages (recomputed later) since start",
            registry=r,
        )
        self.draft_tokens = Gauge(
            "tandem_worker_spec_draft_tokens",
            "Speculative draft tokens verified since start (--speculative-algorithm)",
            registry=r,
        )
        self.accepted_tokens = Gauge(
            "tandem_worker_spec_accepted_tokens", "Of the draft tokens verified, those accepted as output", registry=r
        )
        self.acceptance_rate = Gauge(
            "tandem_worker_spec_acceptance_rate",
            "Accepted draft tokens over draft tokens verified, since start",
            registry=r,
        )
        self.kv_tier_pages = Gauge(
            "tandem_worker_kv_tier_pages",
            "The prefix cache's tiers beyond the pool (tier: host, disk, store): pages held now (stored), and since "
            "start pages saved to it (saved), read back as cache hits (loaded), dropped as damaged (dropped), "
            "lookups that failed (failed: the store did not answer, so the tokens were computed), and saves still "
            "being written in the background (pending)",
            ["tier", "state"],
            registry=r,
        )
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0

    def observe_step(self, seconds: float, num_outputs: int, num_tokens: int, is_overlapped: bool = False) -> None:
        """One engine step took `seconds` to compute and produced `num_outputs` outputs, `num_tokens` of them
        tokens; `is_overlapped`: it was queued while the step before it computed."""
        self.step_seconds.observe(seconds)
        if is_overlapped:
            self.overlapped_steps.inc()
        self.step_batch_size.observe(num_outputs)
        if num_tokens:
            self.generation_tokens.inc(num_tokens)

    def observe_stats(self, stats: EngineStats) -> None:
        """Queue depths and KV pages from an `Engine.stats()` snapshot."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.num_loading.set(stats.num_loading)
        self.num_sending.set(stats.num_sending)
        self.kv_pages_capacity.set(stats.num_total_pages)
        self.kv_pages.labels("free").set(stats.num_free_pages)
        self.kv_pages.labels("cached").set(stats.num_cached_pages)
        self.kv_pages.labels("used").set(stats.num_total_pages - stats.num_free_pages - stats.num_cached_pages)
        self.preemptions.set(stats.num_preemptions)
        self.draft_tokens.set(stats.num_draft_tokens)
        self.accepted_tokens.set(stats.num_accepted_tokens)
        self.acceptance_rate.set(stats.num_accepted_tokens / max(1, stats.num_draft_tokens))
        for tier in stats.tiers:
            for state, value in (
                ("stored", tier.num_pages),
                ("saved", tier.num_saved),
                ("loaded", tier.num_loaded),
                ("dropped", tier.num_dropped),
                ("failed", tier.num_failed),
                ("pending", tier.num_pending),
            ):
                self.kv_tier_pages.labels(tier.tier, state).set(value)

    def record_prefill(
        self, num_prompt_tokens: int, num_cached_tokens: int, kv_bytes: int, transfer_seconds: float
    ) -> None:
        """One prefill request done: its prompt, its cache hits and its KV write. Event loop only."""
        self._num_prompt_tokens += num_prompt_tokens
        self._num_cached_tokens += num_cached_tokens
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_prompt_tokens.inc(num_cached_tokens)
        self.prefix_cache_hit_rate.set(self._num_cached_tokens / max(1, self._num_prompt_tokens))
        self.kv_transfer_bytes.inc(kv_bytes)
        self.kv_transfer_seconds.observe(transfer_seconds)

    def record_reserve(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """One handoff reserved on this decode worker, `num_cached_tokens` of its prompt already held.
        Event loop only."""
        self.handoff_prompt_tokens.inc(num_prompt_tokens)
        self.handoff_cached_tokens.inc(num_cached_tokens)

    def interceptor(self) -> RpcMetricsInterceptor:
        return RpcMetricsInterceptor(self.requests)


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts each `tandem.v1` RPC once it ends, labelled with its method and final status code
    (CANCELLED when the client went away; UNKNOWN for an exception that set no code)."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(_SERVICE_PREFIX):
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(method, handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        return handler

    def _unary(self, method: str, behavior: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
        async def counted(request, context: grpc.aio.ServicerContext):
            try:
                response = await behavior(request, context)
            except BaseException as exc:
                self._count(method, context, exc)
                raise
            self._count(method, context, None)
            return response

        return counted

    def _stream(self, method: str, behavior: Callable[..., AsyncIterator]) -> Callable[..., AsyncIterator]:
        async def counted(request, context: grpc.aio.ServicerContext):
            try:
                async for response in behavior(request, context):
                    yield response
            except BaseException as exc:
                self._count(method, context, exc)
                raise
            self._count(method, context, None)

        return counted

    def _count(self, method: str, context: grpc.aio.ServicerContext, exc: BaseException | None) -> None:
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            code = grpc.StatusCode.CANCELLED
        else:
            code = context.code() or (grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN)
        self._counter.labels(method, code.name).inc()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serve `registry` as Prometheus text on http://host:port/ (any path, `/metrics` included) from
    prometheus_client's own daemon thread, which only reads metric values. Raises OSError if the port
    is taken. Call `.shutdown()` on the result to stop it."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
