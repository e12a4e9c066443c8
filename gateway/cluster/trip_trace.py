"""The spans of one trip (`gateway/cluster/trip.py`), under the request's span (docs/tracing.md).

`first_token` runs from the trip's start to its first token, with the phases before it as children:
`route`, `reserve` (admission's wait and the decode worker's Reserve) and `prefill` (the Prefill
call, whose traceparent the prefill worker's spans hang from). `finish` runs from the first token to
the finish, the decode worker's Generate under it. A trip whose request is not traced (tracing off,
or an unsampled caller) records nothing: every method returns at its first check.
"""

from __future__ import annotations

import asyncio
import time

from gateway.cluster.routing import Route
from gateway.records import TokenChunk
from tandem import tracing


class TripTrace:
    """One trip's spans, from `started` (perf_counter seconds) under `parent`'s span (None: no trace).
    Phases are marked in order; each starts where the one before it ended. Event loop only."""

    __slots__ = ("_parent", "_first", "_first_context", "_finish", "_prefill", "_mark", "_num_tokens")

    def __init__(self, parent: tracing.Context | None, started: float) -> None:
        self._parent = parent
        self._first = tracing.start_span("first_token", parent, started)
        self._first_context = tracing.context_of(self._first, parent)
        self._finish: tracing.Span | None = None
        self._prefill: tracing.Span | None = None
        self._mark = started
        self._num_tokens = 0

    def routed(self, route: Route) -> None:
        """The route was chosen."""
        if self._first is None:
            return
        attributes = {
            "tandem.router_policy": route.policy.value,
            "tandem.decode_worker": route.decode.address,
            "tandem.prefill_worker": "" if route.prefill is None else route.prefill.address,
            "tandem.prefill_path": "local" if route.is_local else "disaggregated",
            "tandem.estimated_cached_tokens": route.estimated_cached_tokens,
            "tandem.estimated_decode_cached_tokens": route.estimated_decode_cached_tokens,
        }
        self._phase("route", attributes)

    def reserved(self, route: Route) -> None:
        """The decode worker holds the prompt's pages (after admission's wait, if any)."""
        if self._first is not None:
            self._phase("reserve", {"tandem.decode_worker": route.decode.address})

    def prefill_metadata(self, route: Route) -> tracing.Metadata:
        """Start the `prefill` call's span; the metadata that carries it to the prefill worker."""
        if self._first is None or route.prefill is None:
            return ()
        self._prefill = tracing.start_span(
            "prefill",
            self._first_context,
            kind=tracing.SpanKind.CLIENT,
            attributes={"tandem.prefill_worker": route.prefill.address},
        )
        return tracing.to_metadata(tracing.context_of(self._prefill, self._first_context))

    def local_metadata(self) -> tracing.Metadata:
        """The metadata of a local trip's PrefillAndGenerate: its worker's prefill spans go under `first_token`."""
        return tracing.to_metadata(self._first_context)

    def prefilled(self, cached_tokens: int, kv_bytes: int) -> None:
        if self._prefill is not None:
            self._prefill.set_attributes({"tandem.cached_tokens": cached_tokens, "tandem.kv_bytes": kv_bytes})
            tracing.end_span(self._prefill)
            self._prefill = None

    def decode_metadata(self) -> tracing.Metadata:
        """The metadata of the Generate call: the decode worker's spans go under `finish`."""
        return tracing.to_metadata(tracing.context_of(self._finish, self._parent))

    def saw(self, event: TokenChunk) -> None:
        """An event of the trip on its way to the front: the first ends `first_token` and starts
        `finish`; the one with a finish reason ends `finish`."""
        if self._first is None:
            return
        self._num_tokens += len(event.tokens)
        if self._finish is None:
            if event.timings is not None:
                self._first.set_attribute("tandem.cached_tokens", event.timings.cached_tokens)
            tracing.end_span(self._first)
            self._finish = tracing.start_span("finish", self._parent)
        if event.finish is not None and self._finish is not None:
            self._finish.set_attributes(
                {"tandem.finish_reason": event.finish.reason.value, "tandem.output_tokens": self._num_tokens}
            )
            tracing.end_span(self._finish)
            self._first = None  # done: later calls do nothing

    def failed(self, error: BaseException) -> None:
        """The trip ended without a finish: its open spans end, failed with `error` unless the reader
        stopped (a stop string matched, the client went away), which ends them as "closed"."""
        if self._first is None:
            return
        is_closed = isinstance(error, GeneratorExit | asyncio.CancelledError)
        last = self._finish or self._first
        if is_closed:
            last.set_attributes({"tandem.finish_reason": "closed", "tandem.output_tokens": self._num_tokens})
        tracing.end_span(self._prefill, error=None if is_closed else error)
        tracing.end_span(last, error=None if is_closed else error)
        self._first = None

    def _phase(self, name: str, attributes: tracing.Attributes) -> None:
        now = time.perf_counter()
        tracing.record_span(name, self._first_context, self._mark, now, attributes=attributes)
        self._mark = now
