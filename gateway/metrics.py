"""The gateway's Prometheus metrics, served as text at `GET /metrics` (`gateway/api/metrics_routes.py`).

One `GatewayMetrics` per app, with its own registry (never prometheus_client's global one). Who
writes what: `MetricsMiddleware` (`gateway/api/metrics_routes.py`) counts every HTTP request by route
template, method and status and keeps the in-flight gauge; the handoff records time to first token,
inter-token latency, end-to-end latency, its per-phase timings and token counts; admission, the
queue's depth, waits and refusals. The number of ready workers per role is read from the pool at
scrape time (`watch_pool`). Everything runs on the event loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.records import HandoffTimings, Role

_LATENCY_BUCKETS_S = (
    (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75)  # under a second
    + (1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
)
_PHASE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_PHASES = ("gateway_queue", "reserve", "prefill_queue", "prefill_compute", "kv_transfer")


class GatewayMetrics:
    """Every metric of one gateway app, in its own `registry`. Event loop only."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tandem_gateway_requests",
            "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.requests_in_flight = Gauge(
            "tandem_gateway_requests_in_flight",
            "HTTP requests being answered (a stream until its last byte)",
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "tandem_gateway_time_to_first_token_seconds",
            "From the handoff's start (Reserve) to the first token",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "tandem_gateway_inter_token_latency_seconds",
            "Time between tokens from the decode server, per token",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "tandem_gateway_e2e_request_latency_seconds",
            "From the handoff's start to its last token, for generations that finished or were closed by their reader",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.handoff_phase = Histogram(
            "tandem_gateway_handoff_phase_seconds",
            "Each handoff phase: gateway_queue (HTTP arrival to the trip's start), reserve (decode RPC, with any "
            "wait for decode KV space), prefill_queue, prefill_compute, kv_transfer (as the prefill server reports "
            "them), decode_queue (as the decode server reports it)",
            ["phase"],
            buckets=_PHASE_BUCKETS_S,
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "tandem_gateway_kv_transfer_bytes",
            "KV bytes the prefill servers wrote for this gateway's requests",
            registry=r,
        )
        self.prompt_tokens = Counter("tandem_gateway_prompt_tokens", "Prompt tokens of handoffs", registry=r)
        self.cached_prompt_tokens = Counter(
            "tandem_gateway_cached_prompt_tokens",
            "Prompt tokens the prefill servers served from their prefix cache",
            registry=r,
        )
        self.generation_tokens = Counter(
            "tandem_gateway_generation_tokens", "Tokens received from the workers", registry=r
        )
        self.generations = Counter(
            "tandem_gateway_generations",
            "Handoffs by outcome: stop, length, abort (the worker's finish reason), "
            "closed (the reader stopped first: a stop string, or the client left), error",
            ["outcome"],
            registry=r,
        )
        self.workers_ready = Gauge(
            "tandem_gateway_workers_ready", "Workers answering their health check, by role", ["role"], registry=r
        )
        self.queued_requests = Gauge(
            "tandem_gateway_queued_requests",
            "Generations waiting for decode KV space (gateway/cluster/admission.py)",
            registry=r,
        )
        self.queue_wait = Histogram(
            "tandem_gateway_queue_wait_seconds",
            "Time generations that had to queue spent waiting for decode KV space",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.admission_refused = Counter(
            "tandem_gateway_admission_refused",
            "Generations refused by admission: queue_full, queue_timeout",
            ["reason"],
            registry=r,
        )

    def observe_first_token(self, timings: HandoffTimings, num_prompt_tokens: int) -> None:
        self.time_to_first_token.observe(timings.first_token_ms / 1000)
        for phase, ms in zip(
            _PHASES,
            (
                timings.gateway_queue_ms,
                timings.reserve_ms,
                timings.prefill_queue_ms,
                timings.prefill_compute_ms,
                timings.transfer_ms,
            ),
        ):
            self.handoff_phase.labels(phase).observe(ms / 1000)
        self.kv_transfer_bytes.inc(timings.kv_bytes)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_prompt_tokens.inc(timings.cached_tokens)
        self.generation_tokens.inc()

    def observe_decode_queue(self, ms: float) -> None:
        self.handoff_phase.labels("decode_queue").observe(ms / 1000)

    def observe_tokens(self, num_tokens: int, seconds: float) -> None:
        """`num_tokens` arrived together, `seconds` after the previous ones: each token waited its share."""
        if num_tokens:
            for _ in range(num_tokens):
                self.inter_token_latency.observe(seconds / num_tokens)
            self.generation_tokens.inc(num_tokens)

    def observe_end(self, outcome: str, seconds: float) -> None:
        self.generations.labels(outcome).inc()
        if outcome != "error":
            self.e2e_latency.observe(seconds)

    def watch_pool(self, num_ready: Callable[[Role], int]) -> None:
        """Read the ready workers of each role through `num_ready` whenever /metrics is scraped."""
        for role in Role:
            self.workers_ready.labels(role.value).set_function(functools.partial(num_ready, role))

    def render(self) -> bytes:
        return generate_latest(self.registry)
