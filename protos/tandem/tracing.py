"""OpenTelemetry traces, off unless `--otlp-traces-endpoint` names a collector (docs/tracing.md).

One trace per request: the gateway's span of the call (FastAPI's own for HTTP, `gateway/grpc_api/
tracing.py` for the client API; joined to the caller's W3C `traceparent` when one comes), its phases
as children, and the workers' spans under the calls that carry the trace's context to them in gRPC
metadata. The entry point calls `tracing_to` once per process; everything else uses the helpers
below, which do nothing for a request that is not traced (tracing off, or a caller's trace that is
not sampled), so the cost off is a context lookup per phase. The SDK and the exporter are imported
only when tracing starts. `Context`, `Span` and `SpanKind` are OpenTelemetry's, named from here.

Times: the gateway and workers measure phases with `time.perf_counter()`; `record_span` turns those
into the epoch nanoseconds spans carry, so a phase can be recorded after it is over, from the very
measurements the timings and metrics use. No span names prompt text: ids, counts, worker addresses.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from urllib.parse import urlparse

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

logger = logging.getLogger(__name__)

TRACER_NAME = "tandem"
ENDPOINT_SCHEMES = ("http", "https", "grpc")  # http: plaintext; https: TLS; grpc: as OTEL_EXPORTER_OTLP_INSECURE says
Metadata = tuple[tuple[str, str], ...]  # gRPC metadata: (key, value) pairs
Attributes = Mapping[str, str | int | float | bool]


def check_endpoint(endpoint: str | None) -> None:
    """ValueError unless `endpoint` is None or an OTLP/gRPC collector's URL (http://host:4317, plaintext;
    https://host:4317, TLS); a bare host:port would be sent TLS by the exporter, so it is refused."""
    if endpoint is None:
        return
    parsed = urlparse(endpoint)
    if parsed.scheme not in ENDPOINT_SCHEMES or not parsed.netloc:
        raise ValueError(
            f"otlp_traces_endpoint must be a URL such as http://host:4317 (plaintext) or https://host:4317 (TLS), "
            f"got {endpoint!r}"
        )


@contextlib.contextmanager
def tracing_to(endpoint: str | None, service_name: str) -> Iterator[None]:
    """Export this process's spans to the OTLP/gRPC collector at `endpoint` while the block runs, named
    `service_name`; the spans still queued are sent when it ends. None: nothing is set up at all."""
    if endpoint is None:
        yield
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    check_endpoint(endpoint)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)  # once per process: OpenTelemetry's own registry, like logging's
    logger.info("exporting traces to %s as %s", endpoint, service_name)
    try:
        yield
    finally:
        provider.shutdown()  # flushes the batch processor


def _tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def current() -> Context:
    """The current context (its span: the request's span, when tracing)."""
    return otel_context.get_current()


def is_on() -> bool:
    """Whether this process exports spans (`tracing_to` with an endpoint)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def is_traced(parent: Context | None) -> bool:
    """Whether spans under `parent`'s span are recorded: one of this process's own that is recording,
    or a caller's (another process's) whose trace is sampled."""
    if parent is None:
        return False
    span_context = trace.get_current_span(parent).get_span_context()
    return span_context.is_valid and span_context.trace_flags.sampled


def from_headers(headers: Mapping[str, str] | Sequence[tuple[str, str | bytes]]) -> Context:
    """The caller's trace context from W3C `traceparent` / `tracestate` headers or gRPC metadata (an
    empty context when there is none, or it is malformed)."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    carrier = {key.lower(): value for key, value in pairs if isinstance(value, str)}
    if "traceparent" not in carrier:
        return Context()
    return propagate.extract(carrier, context=Context())


def caller_context(metadata: Sequence[tuple[str, str | bytes]] | None) -> Context | None:
    """A worker's parent for a call's spans: the trace context its gRPC `metadata` carries; None
    when this process does not trace or the call carries no sampled trace."""
    if not metadata or not is_on():
        return None
    parent = from_headers(metadata)
    return parent if is_traced(parent) else None


def to_metadata(parent: Context | None) -> Metadata:
    """`parent`'s span as gRPC metadata (`traceparent`, `tracestate`) for the call it makes; () when
    it is not traced."""
    if not is_traced(parent):
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=parent)
    return tuple(carrier.items())


def start_span(
    name: str,
    parent: Context | None,
    start: float | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
) -> Span | None:
    """A span under `parent`'s span from `start` (perf_counter seconds; None: now), open until
    `end_span`; None when `parent` is not traced."""
    if not is_traced(parent):
        return None
    start_ns = None if start is None else epoch_ns(start)
    return _tracer().start_span(name, parent, kind, attributes, start_time=start_ns)


def start_root_span(name: str, caller: Context, attributes: Attributes | None = None) -> Span:
    """A front's span for one request, under the caller's trace when `caller` has one (else a new
    trace); SERVER kind. Call only while tracing (see `is_on`)."""
    return _tracer().start_span(name, caller, SpanKind.SERVER, attributes)


def end_span(span: Span | None, end: float | None = None, error: BaseException | str | None = None) -> None:
    """End `span` (None: nothing) at `end` (perf_counter seconds; None: now), as failed when `error`
    is set (an exception: its type names the failure, never its message, which may name internals)."""
    if span is None:
        return
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error if isinstance(error, str) else type(error).__name__))
    span.end(None if end is None else epoch_ns(end))


def record_span(
    name: str,
    parent: Context | None,
    start: float,
    end: float,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
) -> Context | None:
    """A span of a phase already over, from `start` to `end` (perf_counter seconds), under `parent`'s
    span; returns its context, the parent of its own phases (None when `parent` is not traced)."""
    span = start_span(name, parent, start, kind, attributes)
    if span is None:
        return None
    span.end(epoch_ns(end))
    return trace.set_span_in_context(span, parent)


def context_of(span: Span | None, parent: Context | None) -> Context | None:
    """The context whose span is `span` (under `parent`), for its children and calls; None for None."""
    return None if span is None else trace.set_span_in_context(span, parent)


@contextlib.contextmanager
def span(name: str, attributes: Attributes | None = None) -> Iterator[Span | None]:
    """A child of the current span, current while the block runs (for plain functions and coroutines,
    never across an async generator's yields); nothing when the current span is not recording."""
    if not trace.get_current_span().is_recording():
        yield None
        return
    # Exceptions are recorded by type only: a message may quote the request's text.
    with _tracer().start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as child:
        try:
            yield child
        except Exception as exc:
            child.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise


@contextlib.contextmanager
def attached(parent: Context | None) -> Iterator[None]:
    """`parent` as the current context while the block runs (a front's request span, around its
    handler; never across an async generator's yields to another task); None: nothing changes."""
    if parent is None:
        yield
        return
    token = otel_context.attach(parent)
    try:
        yield
    finally:
        otel_context.detach(token)


def epoch_ns(perf_s: float) -> int:
    """A `time.perf_counter()` reading as nanoseconds since the epoch (what spans carry)."""
    return time.time_ns() - round((time.perf_counter() - perf_s) * 1e9)
