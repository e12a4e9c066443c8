"""A worker's spans of one call, recorded when it is over from the times the call measured anyway (the
ones its answer reports), under the caller's span from the call's `traceparent` metadata
(`tandem.tracing.caller_context`; docs/tracing.md). A call without a traced parent records nothing."""

from __future__ import annotations

from tandem import tracing

SERVER = tracing.SpanKind.SERVER


def record_prefill(
    parent: tracing.Context | None,
    received: float,
    started: float,
    computed: float,
    transfer: tuple[float, float] | None,
    num_tokens: int,
    cached_tokens: int,
    kv_bytes: int = 0,
) -> None:
    """A worker's `prefill` span of a prompt of `num_tokens` from `received` (perf_counter seconds)
    to the end of its KV write, with `prefill_queue` (until the engine `started` the prompt),
    `prefill_compute` (until it was `computed`) and `kv_transfer` (`transfer`: the write's start and
    end) under it. A local prefill (a decode worker's PrefillAndGenerate) writes no KV: `transfer`
    None, and its span ends when computed."""
    if parent is None:
        return
    end = computed if transfer is None else transfer[1]
    attributes = {"tandem.prompt_tokens": num_tokens, "tandem.cached_tokens": cached_tokens}
    own = tracing.record_span("prefill", parent, received, end, SERVER, attributes)
    tracing.record_span("prefill_queue", own, received, started)
    tracing.record_span("prefill_compute", own, started, computed)
    if transfer is not None:
        tracing.record_span("kv_transfer", own, *transfer, attributes={"tandem.kv_bytes": kv_bytes})


def record_local_prefill(
    parent: tracing.Context | None,
    received: float,
    queue_ms: float,
    compute_ms: float,
    num_tokens: int,
    cached_tokens: int,
) -> None:
    """A decode worker's `prefill` span of a PrefillAndGenerate call (no KV transfer), from the queue and
    compute times its first message reports."""
    started = received + queue_ms / 1000
    record_prefill(parent, received, started, started + compute_ms / 1000, None, num_tokens, cached_tokens)


def record_decode(
    parent: tracing.Context | None, received: float, admitted: float | None, ended: float, num_tokens: int
) -> None:
    """A decode worker's `decode` span of a Generate call, from `received` to `ended`, with
    `decode_queue` until the engine `admitted` the request into its batch (None: never)."""
    if parent is None:
        return
    own = tracing.record_span("decode", parent, received, ended, SERVER, {"tandem.output_tokens": num_tokens})
    if admitted is not None:
        tracing.record_span("decode_queue", own, received, admitted)
