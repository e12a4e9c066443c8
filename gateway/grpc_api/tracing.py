"""The gRPC API's span of each call (docs/tracing.md): installed only under `--otlp-traces-endpoint`."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc

from tandem import tracing

_UNTRACED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # probes and tooling, not requests


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """One SERVER span per call of a request-response or server-streaming RPC, named by its method, in
    the caller's trace when its `traceparent` metadata names one (else a new trace), current while the
    servicer runs, so the request's phases go under it. Ends with the call, a stream's last message
    included; a call that raises (an abort included) ends it failed."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method  # type: ignore[attr-defined]
        if handler is None or handler.request_streaming or method.startswith(_UNTRACED_PREFIXES):
            return handler
        caller = tracing.from_headers(details.invocation_metadata or ())  # type: ignore[attr-defined]
        name = method.lstrip("/")
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _traced_stream(handler.unary_stream, name, caller),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            _traced_unary(handler.unary_unary, name, caller), handler.request_deserializer, handler.response_serializer
        )


@contextlib.contextmanager
def _call_span(name: str, caller: tracing.Context) -> Iterator[None]:
    """The call's root span, current inside the block; ended failed if the block raises (a cancelled
    call is no failure of ours)."""
    span = tracing.start_root_span(name, caller, {"rpc.system": "grpc", "rpc.method": name})
    error: BaseException | None = None
    try:
        with tracing.attached(tracing.context_of(span, caller)):
            yield
    except Exception as exc:
        error = exc
        raise
    finally:
        tracing.end_span(span, error=error)


def _traced_unary(behavior: Callable[..., Any], name: str, caller: tracing.Context) -> Callable[..., Any]:
    async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with _call_span(name, caller):
            return await behavior(request, context)

    return traced


def _traced_stream(behavior: Callable[..., Any], name: str, caller: tracing.Context) -> Callable[..., Any]:
    async def traced(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        # grpc.aio iterates a call's stream in the call's own task, so the context attached here is
        # that task's alone between the yields.
        with _call_span(name, caller):
            produced = behavior(request, context)
            if inspect.isasyncgen(produced):
                async for message in produced:
                    yield message
            else:  # a servicer that writes with context.write()
                await produced

    return traced
