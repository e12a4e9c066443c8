"""The gateway's Prometheus metrics, served as text at `GET /metrics` (`gateway/api/metrics_routes.py`).

One `GatewayMetrics` per app, with its own registry (never prometheus_client's global one). Who
writes what: `MetricsMiddleware` (`gateway/api/metrics_routes.py`) counts every HTTP request by route
template, method and status and keeps the in-flight gauge; the handoff records time to first token,
inter-token latency, end-to-end latency, its per-phase timings and token counts; admission, the
queue's depth, waits and refusals; the trip, each routing decision (policy, worker, reason), the
cached tokens the router estimated and those the prefill worker reported, the prompt tokens decode
workers already held, and failovers; the pool's KV event streams, the events received. The number
of ready workers per role, of workers whose KV events are live, and each worker's load are read from
the pool at scrape time (`watch_pool`, `watch_kv_events`, `watch_loads`). Everything runs on the
event loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.records import HandoffTimings, PrefillPath, Role

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
        self.decode_cached_prompt_tokens = Counter(
            "tandem_gateway_decode_cached_prompt_tokens",
            "Prompt tokens the decode workers already held in their prefix cache: a handoff's reservation "
            "(the prefill server did not write them) or a local prefill's cache hits",
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

        self.route_decisions = Counter(
            "tandem_gateway_route_decisions",
            "Workers chosen for requests, by router policy, role, worker address and reason (round_robin, "
            "least_load, prefix_match, load_guard; for decode too); a prompt its decode worker prefills has no "
            "prefill decision "
            "(see tandem_gateway_prefill_path)",
            ["policy", "role", "worker", "reason"],
            registry=r,
        )
        self.prefill_path = Counter(
            "tandem_gateway_prefill_path",
            "Requests by the worker that prefilled them: disaggregated (a prefill worker) or local (the decode "
            "worker: short_prompt, decode_cached, prefill_busy), with the reason",
            ["path", "reason"],
            registry=r,
        )
        self.route_cached_tokens = Counter(
            "tandem_gateway_route_cached_tokens",
            "Prompt tokens of requests sent to each prefill worker that the router estimated it held in its prefix "
            "cache (kind=estimated) and that it reported serving from there (kind=real)",
            ["worker", "kind"],
            registry=r,
        )
        self.kv_events = Counter(
            "tandem_gateway_kv_events",
            "What the workers' KV event streams told the router: snapshots received (kind=snapshot), and page "
            "keys stored in and removed from their prefix caches (kind=stored, kind=removed; a snapshot's own "
            "keys count as stored)",
            ["kind"],
            registry=r,
        )
        self.kv_events_live_workers = Gauge(
            "tandem_gateway_kv_events_live_workers",
            "Workers whose KV event stream is live, by role: the router reads their prefix cache exactly "
            "(the others' it guesses from what it routed there)",
            ["role"],
            registry=r,
        )
        self.failovers = Counter(
            "tandem_gateway_failovers",
            "Requests tried again on other workers after a worker failed before their first token",
            registry=r,
        )

    def observe_route(
        self, policy: str, prefill: str | None, prefill_reason: str, decode: str, decode_reason: str, estimated: int
    ) -> None:
        """One routing decision: the prefill worker's address (None: the decode worker prefills the
        prompt itself, for `prefill_reason`) and the decode worker's, each with why it was chosen, and the
        prompt tokens the router expects the prefill worker to hold in its cache."""
        self.route_decisions.labels(policy, "decode", decode, decode_reason).inc()
        if prefill is None:
            self.prefill_path.labels(PrefillPath.LOCAL.value, prefill_reason).inc()
            return
        self.prefill_path.labels(PrefillPath.DISAGGREGATED.value, prefill_reason).inc()
        self.route_decisions.labels(policy, "prefill", prefill, prefill_reason).inc()
        self.route_cached_tokens.labels(prefill, "estimated").inc(estimated)

    def observe_cached(self, prefill_address: str, cached_tokens: int) -> None:
        """The prefill worker at `prefill_address` reports `cached_tokens` of a prompt came from its cache."""
        self.route_cached_tokens.labels(prefill_address, "real").inc(cached_tokens)

    def observe_first_token(self, timings: HandoffTimings, num_prompt_tokens: int) -> None:
        """The first token's latency and phases (a prompt its decode worker prefilled has no reserve or
        KV transfer phase), and the prompt's token counts."""
        self.time_to_first_token.observe(timings.first_token_ms / 1000)
        skipped = ("reserve", "kv_transfer") if timings.prefill_path is PrefillPath.LOCAL else ()
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
            if phase not in skipped:
                self.handoff_phase.labels(phase).observe(ms / 1000)
        self.kv_transfer_bytes.inc(timings.kv_bytes)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_prompt_tokens.inc(timings.cached_tokens)
        self.decode_cached_prompt_tokens.inc(timings.decode_cached_tokens)
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

    def observe_kv_events(self, is_snapshot: bool, num_stored: int, num_removed: int) -> None:
        """One message of a worker's KV event stream: a snapshot or a delta, with its keys' counts."""
        if is_snapshot:
            self.kv_events.labels("snapshot").inc()
        if num_stored:
            self.kv_events.labels("stored").inc(num_stored)
        if num_removed:
            self.kv_events.labels("removed").inc(num_removed)

    def watch_kv_events(self, num_live: Callable[[Role], int]) -> None:
        """Read the workers of each role whose KV events are live through `num_live` whenever /metrics
        is scraped."""
        for role in Role:
            self.kv_events_live_workers.labels(role.value).set_function(functools.partial(num_live, role))

    def watch_loads(self, read: Callable[[], Iterable[tuple[str, str, dict[str, float]]]]) -> None:
        """Serve `tandem_gateway_worker_load{role,worker,measure}` from `read()` at each scrape: per worker
        (role, address, {measure: value}); the measures are the gateway's requests in flight there and
        the worker's last reported running and waiting requests and free pages."""
        self.registry.register(_LoadCollector(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LoadCollector(Collector):
    """Each worker's load, read from the pool when scraped (workers come and go with DNS)."""

    def __init__(self, read: Callable[[], Iterable[tuple[str, str, dict[str, float]]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "tandem_gateway_worker_load",
            "Each worker's load as the router sees it: in_flight (this gateway's requests there now), running, "
            "waiting and free_pages (free or only cached; its last report)",
            labels=["role", "worker", "measure"],
        )
        for role, address, measures in self._read():
            for measure, value in measures.items():
                family.add_metric([role, address, measure], value)
        yield family
