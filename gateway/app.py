"""The FastAPI application: routes, error handlers, start-up (tokenizer, worker pool)."""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.telemetry import TelemetryConfig
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.main import STARTUP_FAILURE

from gateway.api import (
    admin,
    anthropic,
    embeddings,
    experts,
    invocations,
    metrics_routes,
    native,
    openai,
    scoring,
    vllm,
)
from gateway.api.auth import AuthMiddleware, log_key_policy
from gateway.api.body_limit import BodyLimitMiddleware, BodyTooLarge
from gateway.api.caller_middleware import CallerMiddleware
from gateway.api.metrics_routes import MetricsMiddleware
from gateway.api.openai_responses_routes import router as responses_router
from gateway.batch import batches_routes, files_routes
from gateway.batch.runner import run_batches
from gateway.batch.traffic import InteractiveTraffic, TrafficMiddleware
from gateway.cluster.admission import Admission
from gateway.cluster.pool import WorkerPool
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.grpc_api.server import serving_grpc_api
from gateway.metrics import GatewayMetrics
from gateway.service.generation import GenerationService
from gateway.service.openai_responses import serving_responses
from gateway.service.state import GatewayState
from gateway.text.tokenizer import load_tokenizer

# Every router of the app, in the order they are mounted.
ROUTERS = (
    openai.router,
    responses_router,
    anthropic.router,
    native.router,
    admin.router,
    vllm.router,
    files_routes.router,
    batches_routes.router,
    embeddings.router,
    scoring.router,
    invocations.router,
    experts.router,
    metrics_routes.router,
)

logger = logging.getLogger(__name__)

# FastAPI's own OpenTelemetry: each HTTP request's span (the caller's traceparent joined, named by its
# route), the root of the request's trace (docs/tracing.md), made only while `--otlp-traces-endpoint` has
# set up a tracer provider. No metrics (Prometheus has them), no logs (they may quote a request's body),
# no exporters of FastAPI's own from OTEL_* variables: the flag is the one switch.
TELEMETRY = TelemetryConfig(metrics=False, logs=False, operation_spans=False, auto_configure=False)


def create_app(config: GatewayConfig, is_stopping: Callable[[], bool] = lambda: False) -> FastAPI:
    """The gateway's app. `is_stopping()` turns true when the HTTP server got its stop signal: the
    gRPC API then drains alongside HTTP, not after it."""
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model_path)
    traffic = InteractiveTraffic(config.batch_yield_threshold)
    gateway_metrics = GatewayMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = WorkerPool(
            config.prefill_addrs,
            config.decode_addrs,
            credentials=config.internal,
            admission=Admission(config.max_queued_requests, config.max_queue_wait_s, gateway_metrics),
            routing=config.routing,
            metrics=gateway_metrics,
        )
        gateway_metrics.watch_pool(pool.num_ready)
        gateway_metrics.watch_kv_events(pool.num_kv_events_live)
        gateway_metrics.watch_loads(pool.loads)
        generation = GenerationService(pool, config, tokenizer, gateway_metrics)
        app.state.gateway = GatewayState(config, tokenizer, pool, gateway_metrics, generation)
        await pool.probe_all()
        pool.start()
        async with (
            run_batches(app, config.data_dir, traffic, config.batch_concurrency, lambda: pool.is_ready),
            serving_grpc_api(app.state.gateway, config.drain_timeout_s, is_stopping),
            serving_responses(app, config.data_dir),
        ):
            yield
        await pool.close()

    app = FastAPI(title="Tandem gateway", lifespan=lifespan, telemetry=TELEMETRY)
    for router in ROUTERS:
        app.include_router(router)
    # Starlette types a handler as taking any Exception; each of these takes only the class it is registered for.
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_middleware(MetricsMiddleware, metrics=gateway_metrics)  # first added: innermost, sees the route
    app.add_middleware(TrafficMiddleware, traffic=traffic)
    app.add_middleware(_JSONBodyMiddleware)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=config.max_request_body_bytes,
        route_limits={"/v1/files": files_routes.MAX_UPLOAD_BODY_BYTES},
    )
    app.add_middleware(CallerMiddleware)  # the tenant, for the admission queue
    app.add_middleware(AuthMiddleware, api_key=config.api_key, admin_api_key=config.admin_api_key)  # outermost
    log_key_policy(config)
    return app


class _JSONBodyMiddleware:
    """Treat POST bodies as JSON whatever their content type, as SGLang does: `curl -d '{...}'`
    (which sends application/x-www-form-urlencoded) must work, as in SGLang's quick start."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            original = dict(scope["headers"]).get(b"content-type", b"")
            if not original.startswith(b"multipart/"):
                scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        where = first.get("loc", ("body", None))[-1]
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return JSONResponse(
            APIError(
                400, f"the request body is not valid JSON: {reason} (at character {where})", code="invalid_json"
            ).body(),
            status_code=400,
        )
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request body")
    return JSONResponse(APIError(400, message, param=param).body(), status_code=400)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if isinstance(exc, BodyTooLarge):  # the rest of the body stays unread: close rather than drain it
        return JSONResponse(exc.body(), status_code=413, headers={"Connection": "close"})
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(APIError(exc.status_code, str(exc.detail), kind).body(), status_code=exc.status_code)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return JSONResponse(APIError(500, "internal server error", "internal_error").body(), status_code=500)


def serve_gateway(config: GatewayConfig) -> None:
    server: uvicorn.Server | None = None
    app = create_app(config, is_stopping=lambda: server is not None and server.should_exit)
    # On SIGTERM uvicorn closes the listening socket, lets the responses in flight finish (streams
    # included) for up to the drain timeout, then runs the lifespan's shutdown; the gRPC API drains
    # meanwhile (it sees `should_exit`).
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="info",
            timeout_graceful_shutdown=math.ceil(config.drain_timeout_s),
        )
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:  # the lifespan's start-up failed: exit as uvicorn.run would
        sys.exit(STARTUP_FAILURE)
