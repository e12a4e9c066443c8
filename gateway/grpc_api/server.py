"""The gRPC API's server, in the gateway's event loop beside HTTP: InferenceService, grpc.health.v1
(SERVING while the worker pool is ready: at least one prefill and one decode worker) and server
reflection, with --api-key checked on every call but health's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.grpc_api.servicer import InferenceServicer
from gateway.grpc_api.tracing import TracingInterceptor
from gateway.service.api_keys import bearer, matches_any
from gateway.service.state import GatewayState
from tandem.api.v1 import inference_service_pb2, inference_service_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = inference_service_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
_HEALTH_POLL_S = 0.5
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a request as large as an HTTP body may be; answers of long prompts' logprobs


@contextlib.asynccontextmanager
async def serving_grpc_api(
    state: GatewayState, drain_timeout_s: float, is_stopping: Callable[[], bool] = lambda: False
) -> AsyncIterator[None]:
    """The gRPC API on the gateway's host and --grpc-port while the block runs; none for port 0.
    It drains once `is_stopping()` (the HTTP server's SIGTERM, seen within a health poll) or on exit,
    whichever comes first: health turns NOT_SERVING, no new call is taken, and the calls in flight
    get up to `drain_timeout_s` to finish. The exit waits for the drain."""
    config = state.config
    if not config.grpc_port:
        yield
        return
    keys = tuple(bearer(key) for key in (config.api_key, config.admin_api_key) if key)
    # The key check as HTTP's user routes have it (open without a user key); the trace's span outside it.
    tracing = [TracingInterceptor()] if config.otlp_traces_endpoint else []
    server = grpc.aio.server(
        interceptors=[*tracing, _KeyCheck(keys if config.api_key else ())],
        options=[
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),  # gRPC's default on Linux would let a second server share the port silently
        ],
    )
    inference_service_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(state), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"[{config.host}]:{config.grpc_port}" if ":" in config.host else f"{config.host}:{config.grpc_port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError:
        raise SystemExit(
            f"the gRPC API cannot listen on {address} (is the port in use?): set --grpc-port, or 0 to turn it off"
        ) from None
    stopping = asyncio.Event()

    def is_ready() -> bool:
        return state.pool.is_ready

    reported = is_ready()
    await _set_health(health_servicer, reported)  # before the port opens: never SERVING too soon
    await server.start()
    logger.info("gRPC API (%s) on %s", SERVICE_NAME, address)
    watcher = asyncio.create_task(_report_health(health_servicer, reported, is_ready, is_stopping, stopping))
    drain = asyncio.create_task(_drain(server, health_servicer, stopping, drain_timeout_s))
    try:
        yield
    finally:
        stopping.set()
        await drain
        watcher.cancel()


async def _drain(
    server: grpc.aio.Server, servicer: health.aio.HealthServicer, stopping: asyncio.Event, drain_timeout_s: float
) -> None:
    await stopping.wait()
    logger.info("gRPC API draining: no new call; up to %g s for those in flight", drain_timeout_s)
    await servicer.enter_graceful_shutdown()  # NOT_SERVING, for good
    await server.stop(drain_timeout_s)


async def _report_health(
    servicer: health.aio.HealthServicer,
    reported: bool,
    is_ready: Callable[[], bool],
    is_stopping: Callable[[], bool],
    stopping: asyncio.Event,
) -> None:
    """Keep the health status of "" and the service (`reported`: SERVING now) in step with the pool
    (Watch sees each change), and set `stopping` once the gateway is."""
    while not is_stopping():
        await asyncio.sleep(_HEALTH_POLL_S)
        if (ready := is_ready()) != reported:
            await _set_health(servicer, ready)
            reported = ready
    stopping.set()


async def _set_health(servicer: health.aio.HealthServicer, ready: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", SERVICE_NAME):
        await servicer.set(service, status)


class _KeyCheck(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without an accepted `authorization: Bearer <key>` (health excepted;
    no key: every call is open). Compared in constant time; the refused call's message is never read."""

    def __init__(self, accepted: tuple[bytes, ...]) -> None:
        self._accepted = accepted

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if not self._accepted or handler is None or details.method.startswith(_HEALTH_PREFIX):  # type: ignore[attr-defined]
            return handler
        given = [value for key, value in details.invocation_metadata or () if key == "authorization"]  # type: ignore[attr-defined]
        if len(given) == 1 and matches_any(_as_bytes(given[0]), self._accepted):
            return handler
        return _refusal(handler)


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "Incorrect API key provided.")


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that refuses the call without deserializing its message."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse)
    return grpc.unary_unary_rpc_method_handler(_refuse)
