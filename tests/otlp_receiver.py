"""An OTLP/gRPC trace receiver in the test process: a real gRPC server on loopback implementing
`opentelemetry.proto.collector.trace.v1.TraceService`, keeping every span exported to it, and the
spans of one trace printed as an indented tree with durations (what docs/tracing.md shows)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One exported span, as the receiver got it (ids in lower-case hex)."""

    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a trace's root
    name: str
    service: str  # the exporting process's service.name
    start_ns: int
    end_ns: int
    attributes: dict[str, object] = field(default_factory=dict)
    is_error: bool = False

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the proto's name)
        received = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                received.extend(_span(span, service) for span in scope_spans.spans)
        with self.lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """The receiver listening on `endpoint` (http://127.0.0.1:PORT, plaintext) until `stop()`."""

    def __init__(self) -> None:
        self._collector = _Collector()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self._collector, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None)

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        """Every span received so far (of `trace_id` only, when given), in arrival order."""
        with self._collector.lock:
            return [s for s in self._collector.spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The spans of `trace_id` once every name in `names` has arrived (processes export in batches,
        each on its own schedule); AssertionError naming the missing ones after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans(trace_id)
            missing = names - {s.name for s in spans}
            if not missing:
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans never received: {sorted(missing)}; got {sorted(s.name for s in spans)}")
            time.sleep(0.1)


    def wait_for_span(self, name: str, timeout_s: float = 30.0) -> ReceivedSpan:
        """The first span named `name` received; AssertionError after `timeout_s` without one."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [s for s in self.spans() if s.name == name]
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no span named {name!r} received")
            time.sleep(0.1)


def format_tree(spans: list[ReceivedSpan], attributes: tuple[str, ...] = ()) -> str:
    """The spans as an indented tree, children in start order: name, service, duration, and the
    values of `attributes` a span has."""
    by_parent: dict[str, list[ReceivedSpan]] = {}
    ids = {s.span_id for s in spans}
    for s in sorted(spans, key=lambda s: s.start_ns):
        by_parent.setdefault(s.parent_span_id if s.parent_span_id in ids else "", []).append(s)
    width = max((len(s.name) + 4 * _depth(s, spans) for s in spans), default=0) + 2
    lines = []
    for depth, s in _walk(by_parent, "", 0):
        label = ("    " * depth + s.name).ljust(width)
        notes = " ".join(f"{key}={s.attributes[key]}" for key in attributes if key in s.attributes)
        lines.append(f"{label}{s.service:<18}{s.duration_ms:9.2f} ms  {notes}".rstrip())
    return "\n".join(lines)


def _walk(by_parent: dict[str, list[ReceivedSpan]], parent: str, depth: int) -> Iterator[tuple[int, ReceivedSpan]]:
    for s in by_parent.get(parent, []):
        yield depth, s
        yield from _walk(by_parent, s.span_id, depth + 1)


def _depth(span: ReceivedSpan, spans: list[ReceivedSpan]) -> int:
    parents = {s.span_id: s.parent_span_id for s in spans}
    depth, parent = 0, span.parent_span_id
    while parent in parents:
        depth, parent = depth + 1, parents[parent]
    return depth


def _span(span, service: str) -> ReceivedSpan:
    return ReceivedSpan(
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        name=span.name,
        service=service,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        attributes={kv.key: _value(kv.value) for kv in span.attributes},
        is_error=span.status.code == span.status.STATUS_CODE_ERROR,
    )


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None
