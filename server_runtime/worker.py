"""Start-up shared by prefill and decode servers: engine, KV transport, gRPC server, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.config import EngineConfig
from engine.engine import Engine
from engine.runner import FaultHooks
from engine.weights import open_checkpoint
from kv_transfer import KVTransport, TransportConfig, create_transport
from server_runtime.common_rpcs import add_worker_servicer
from server_runtime.convert import layout_to_proto, role_to_proto
from server_runtime.embedding import EmbeddingContext, start_embedding
from server_runtime.engine_loop import EngineLoop
from server_runtime.metrics import WorkerMetrics, serve_metrics
import tandem
from tandem.internal_auth import InternalCredentials
from tandem.v1 import common_pb2

logger = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 64 * 2**20
# A test fault hook (tests/chaos), never for production: requests whose sampling seed is this integer
# get NaN logits, so the engine's guard fails them alone.
FAULT_NAN_LOGITS_SEED_ENV = "TANDEM_FAULT_NAN_LOGITS_SEED"
_DRAIN_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a prefill or decode server process needs."""

    role: str                        # "prefill" or "decode"
    model_path: str
    host: str
    port: int
    engine: EngineConfig
    transport: TransportConfig
    torch_threads: int
    reservation_ttl_s: float = 30.0   # decode: pages held for a prefill that never comes
    write_grace_s: float = 30.0       # decode: unused reservation pages rest this long before reuse
    transfer_timeout_s: float = 30.0  # prefill: longest KV write before the request fails
    is_embedding: bool = False        # prefill: serve Embed from an embedding model; no engine, KV or decode
    metrics_port: int = 0             # HTTP port serving Prometheus text; 0: no metrics endpoint
    credentials: InternalCredentials = InternalCredentials()   # the token (and TLS) every tandem.v1 call needs
    # Keys KV write grants (kv_grants.py); the workers' alone, never the gateway's. None: an open plane's public key.
    kv_grant_secret: str | None = field(default=None, repr=False)
    weights_dirs: tuple[str, ...] = ()   # UpdateWeights loads only from under these; (): the model's directory
    grammar_compile_timeout_s: float = 5.0   # a request's grammar that takes longer to compile is refused
    drain_timeout_s: float = 30.0     # on SIGTERM/SIGINT: longest wait for the requests in flight to finish

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port out of range: {self.port}")
        if not (0 <= self.metrics_port < 65536) or (self.metrics_port and self.metrics_port == self.port):
            raise ValueError(f"metrics_port must be 0 (off) or a port other than port, got {self.metrics_port}")
        if self.torch_threads < 1:
            raise ValueError("torch_threads must be >= 1")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError("grammar_compile_timeout_s must be positive")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.reservation_ttl_s <= 0 or self.transfer_timeout_s <= 0 or self.write_grace_s < 0:
            raise ValueError("reservation_ttl_s and transfer_timeout_s must be positive, write_grace_s >= 0")
        if self.is_embedding and self.role != "prefill":
            raise ValueError("is_embedding is for prefill workers only: embeddings need no decode")
        if self.engine.device != "cpu" and not self.is_embedding:
            # The transports read and write the pool as host memory (memmove, Mooncake's CPU build): a
            # device pointer there would crash the process or move garbage.
            raise ValueError(f"KV transfer from {self.engine.device} memory is not supported yet: run prefill "
                             "and decode workers with --device cpu (embedding workers may use a GPU)")


@dataclass(slots=True)
class WorkerContext:
    """What a role's servicer gets: the config, the running engine loop and the KV transport."""

    config: WorkerConfig
    loop: EngineLoop
    transport: KVTransport
    version: str
    is_draining: bool = False   # shutting down: new requests (Reserve, Prefill) are refused, those in flight end

    @property
    def engine(self) -> Engine:
        return self.loop.engine

    @property
    def weights_dirs(self) -> tuple[str, ...]:
        """Where UpdateWeights may load from: --weights-dir, else the served model's directory."""
        if self.config.weights_dirs:
            return self.config.weights_dirs
        path = self.config.model_path
        return (path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)),)

    def model_info(self) -> common_pb2.GetModelInfoResponse:
        engine = self.engine
        return common_pb2.GetModelInfoResponse(
            model_path=self.config.model_path, architecture=engine.model_config.architecture.value,
            context_len=engine.context_len, vocab_size=engine.model_config.vocab_size,
            eos_token_ids=sorted(engine.eos_token_ids), kv_layout=layout_to_proto(engine.runner.layout),
            num_pages=engine.allocator.num_pages, role=role_to_proto(self.config.role), version=self.version,
            weights_id=engine.weights_id)

    async def load(self) -> common_pb2.GetLoadResponse:
        def read(engine: Engine) -> common_pb2.GetLoadResponse:
            return common_pb2.GetLoadResponse(
                num_running=len(engine.scheduler.running), num_waiting=len(engine.scheduler.waiting),
                num_free_pages=engine.allocator.num_free, num_total_pages=engine.allocator.num_pages,
                num_cached_pages=engine.num_cached_pages)
        return await self.loop.call(read)


async def _drain(config: WorkerConfig, context: WorkerContext | EmbeddingContext,
                 health_servicer: health.aio.HealthServicer, stop: asyncio.Event) -> float:
    """Stop taking requests and wait for those in flight, up to `config.drain_timeout_s` or until
    `stop` is set again (a second signal). Returns the seconds left for the gRPC server's own grace.

    From here on health checks answer NOT_SERVING, so gateways send nothing new, and Reserve and
    Prefill refuse what still comes (UNAVAILABLE); health checks, aborts and the Generate streams of
    reservations already made are served as before. An embedding worker has no engine to wait for:
    the server's grace covers its Embed calls.
    """
    await health_servicer.enter_graceful_shutdown()
    stop.clear()
    deadline = time.monotonic() + config.drain_timeout_s
    if isinstance(context, WorkerContext):
        context.is_draining = True
        logger.info("%s server draining: up to %g s for the requests in flight (--drain-timeout)", config.role,
                    config.drain_timeout_s)
        while not await context.loop.call(lambda engine: engine.is_idle):
            if stop.is_set() or time.monotonic() >= deadline:
                logger.warning("%s server stops with requests still in flight (%s)", config.role,
                               "a second signal" if stop.is_set() else "the drain timeout")
                return 0.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _DRAIN_POLL_S)
    return 0.0 if stop.is_set() else max(1.0, deadline - time.monotonic())   # the last answers still go out


def build_engine(config: WorkerConfig) -> Engine:
    torch.set_num_threads(config.torch_threads)
    torch.set_flush_denormal(True)
    checkpoint = open_checkpoint(config.model_path)
    return Engine(checkpoint, config.engine, faults=fault_hooks_from_env())


def fault_hooks_from_env() -> FaultHooks:
    """The test fault hooks set in this process's environment (read here only, once); none when unset."""
    seed = os.environ.get(FAULT_NAN_LOGITS_SEED_ENV)
    if not seed:
        return FaultHooks()
    logger.warning("test fault hook on: requests with seed %s get NaN logits (%s)", seed, FAULT_NAN_LOGITS_SEED_ENV)
    return FaultHooks(nan_logits_seed=int(seed))


async def serve_worker(config: WorkerConfig,
                       add_servicer: Callable[[grpc.aio.Server, WorkerContext | EmbeddingContext], str]) -> None:
    """Load the model, register the KV pool, serve gRPC until SIGINT/SIGTERM, then drain and exit.

    `add_servicer` registers the role's service on the server and returns its full service name; every
    worker also serves WorkerService (`server_runtime/common_rpcs.py`).
    With `config.is_embedding` it gets an `EmbeddingContext` instead: no engine, KV pool or transport.
    """
    context: WorkerContext | EmbeddingContext
    metrics = WorkerMetrics(config.role, config.model_path, tandem.version())
    if config.is_embedding:
        torch.set_num_threads(config.torch_threads)
        torch.set_flush_denormal(True)
        context = start_embedding(config, tandem.version())
        close, transport_text = context.close, "no KV transport: embeddings only"
    else:
        engine = build_engine(config)
        # Mooncake's own transfer timeout must fire before ours, so a write we gave up on can never
        # land later in pages the decode server has freed and handed to another request.
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, int(config.transfer_timeout_s * 0.8))))
        # Mooncake logs a line per transfer at INFO: keep its warnings and errors unless we debug
        # (per-transfer numbers are in the metrics). MC_LOG_LEVEL in the environment wins.
        os.environ.setdefault("MC_LOG_LEVEL", "INFO" if logger.isEnabledFor(logging.DEBUG) else "WARNING")
        transport = create_transport(config.transport)
        pool = engine.runner.kv_pool
        transport.register(pool.base_addr, pool.num_bytes)
        loop = EngineLoop(engine, asyncio.get_running_loop(), metrics)
        loop.start()
        context = WorkerContext(config, loop, transport, tandem.version())
        transport_text = f"KV transport {config.transport.backend} at {transport.session_id}"

        def close() -> None:
            loop.stop()
            transport.close()

    server = grpc.aio.server(interceptors=[*config.credentials.server_interceptors(), metrics.interceptor()],
                             options=[("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                                      ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                                      # the gateway pings every 10 s, with or without calls (gateway/cluster/pool.py)
                                      ("grpc.keepalive_permit_without_calls", 1),
                                      ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000)])
    service_names = (add_servicer(server, context), add_worker_servicer(server, context))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    if config.credentials.add_port(server, address) == 0:
        raise OSError(f"cannot listen on {address}")
    metrics_server = serve_metrics(metrics.registry, config.host, config.metrics_port) if config.metrics_port else None
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for name in service_names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("%s server ready on %s (%s; metrics %s)", config.role, address, transport_text,
                f"on http://{config.host}:{config.metrics_port}/metrics" if metrics_server else "off")

    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    grace_s = await _drain(config, context, health_servicer, stop)
    logger.info("%s server shutting down", config.role)
    await server.stop(grace=grace_s)
    if metrics_server is not None:
        metrics_server.shutdown()
        metrics_server.server_close()
    close()
