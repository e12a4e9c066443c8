"""Start-up and shutdown of a worker: its kind's runtime (an engine with a KV transport, or an embedder),
a gRPC server with health and reflection, metrics; then serving until a signal, drain and exit.

`build_worker(config, kind)` starts a worker and returns it serving (`RunningWorker`);
`serve_until_signal(running)` serves it until SIGINT/SIGTERM. `serve_worker` is the two in a row,
what a worker process runs. Tests build workers in-process the same way, on port 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import tandem
from engine.engine import Engine
from engine.kv_store_tier import StoreAccess
from engine.runner import FaultHooks
from engine.weights import open_checkpoint
from kv_transfer import create_transport
from kv_transfer.mooncake_store import StoreClient
from server_runtime.blocking import use_device
from server_runtime.config import WorkerConfig
from server_runtime.context import EngineFacts, WorkerContext
from server_runtime.embedding import EmbeddingContext, start_embedding
from server_runtime.engine_loop import EngineLoop
from server_runtime.kv_grants import store_page_key
from server_runtime.kv_receive import KVReceiveConnector
from server_runtime.kv_send import KVSendConnector
from server_runtime.lora_serving import LoraAdapters
from server_runtime.metrics import WorkerMetrics, serve_metrics
from server_runtime.threads import ThreadTuner

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

logger = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 64 * 2**20
# A test fault hook (tests/chaos), never for production: requests whose sampling seed is this integer
# get NaN logits, so the engine's guard fails them alone.
FAULT_NAN_LOGITS_SEED_ENV = "TANDEM_FAULT_NAN_LOGITS_SEED"


class Runtime(Protocol):
    """What runs beneath a worker's servicers: `WorkerContext` (an engine) or `EmbeddingContext`."""

    @property
    def config(self) -> WorkerConfig: ...

    @property
    def description(self) -> str: ...  # for the "ready" log line

    async def drain(self, deadline: float, stop: asyncio.Event) -> bool:
        """Refuse new work; wait until none is in flight (True), `deadline` passes or `stop` is set."""

    def close(self) -> None: ...


R = TypeVar("R", bound=Runtime)


@dataclass(frozen=True, slots=True)
class WorkerKind(Generic[R]):
    """A kind of worker, chosen once at start-up: how its runtime starts and which servicers it
    registers (each returns its service's full name). The kinds are defined beside their servicers:
    `prefill_server.servicer.PREFILL`, `prefill_server.embedding_servicer.EMBEDDING`,
    `decode_server.servicer.DECODE`."""

    name: str  # WorkerConfig.kind_name: "prefill", "decode" or "embedding"
    start: Callable[[WorkerConfig, WorkerMetrics], R]
    servicers: tuple[Callable[[grpc.aio.Server, R], str], ...]


@dataclass(slots=True)
class RunningWorker(Generic[R]):
    """A started worker: its runtime (`context`), its gRPC server serving on `address`, the names of
    its services (health and reflection aside), its health servicer and metrics endpoint."""

    config: WorkerConfig
    context: R
    server: grpc.aio.Server
    address: str  # host:port, with the port bound (config.port may be 0)
    service_names: tuple[str, ...]
    health: health.aio.HealthServicer
    metrics_server: WSGIServer | None

    async def drain(self, stop: asyncio.Event) -> float:
        """Stop taking requests and wait for those in flight, up to `config.drain_timeout_s` or until
        `stop` is set again (a second signal). Returns the seconds left for the gRPC server's own grace.

        From here on health checks answer NOT_SERVING, so gateways send nothing new, and Reserve and
        Prefill refuse what still comes (UNAVAILABLE); health checks, aborts and the Generate streams of
        reservations already made are served as before. An embedding worker has nothing to wait for:
        the server's grace covers its Embed calls.
        """
        await self.health.enter_graceful_shutdown()
        stop.clear()
        deadline = time.monotonic() + self.config.drain_timeout_s
        if not await self.context.drain(deadline, stop):
            logger.warning(
                "%s server stops with requests still in flight (%s)",
                self.config.role,
                "a second signal" if stop.is_set() else "the drain timeout",
            )
            return 0.0
        return 0.0 if stop.is_set() else max(1.0, deadline - time.monotonic())  # the last answers still go out

    async def close(self, grace_s: float | None = None) -> None:
        """Stop the gRPC server (calls in flight get `grace_s`; None: cancelled at once), the metrics
        endpoint and the runtime."""
        await self.server.stop(grace=grace_s)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        self.context.close()


async def build_worker(config: WorkerConfig, kind: WorkerKind[R]) -> RunningWorker[R]:
    """Start `kind`'s runtime for `config` and serve its services, WorkerService, health and reflection
    on `config.host:config.port` (0: any free port), plus metrics on `config.metrics_port` when set.
    Returns once every service answers SERVING; `RunningWorker.close()` stops it all. Call it on the
    event loop that will serve the worker."""
    if kind.name != config.kind_name:
        raise ValueError(f"a {config.kind_name} worker's config cannot start a {kind.name} worker")
    metrics = WorkerMetrics(config.role, config.model_path, tandem.version())
    context = kind.start(config, metrics)
    try:
        server = _grpc_server(config, metrics)
        service_names = tuple(add(server, context) for add in kind.servicers)
        health_servicer = _add_health_and_reflection(server, service_names)
        address = _listen(server, config)
        metrics_server = (
            serve_metrics(metrics.registry, config.host, config.metrics_port) if config.metrics_port else None
        )
    except BaseException:
        context.close()
        raise
    await server.start()
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info(
        "%s server ready on %s (%s; metrics %s)",
        config.role,
        address,
        context.description,
        f"on http://{config.host}:{config.metrics_port}/metrics" if metrics_server else "off",
    )
    return RunningWorker(config, context, server, address, service_names, health_servicer, metrics_server)


async def serve_until_signal(running: RunningWorker) -> None:
    """Serve until SIGINT or SIGTERM, then drain (a second signal cuts it short) and close."""
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    grace_s = await running.drain(stop)
    logger.info("%s server shutting down", running.config.role)
    await running.close(grace_s)


async def serve_worker(config: WorkerConfig, kind: WorkerKind) -> None:
    """A worker process's life: build the worker, serve it until a signal, drain and close."""
    await serve_until_signal(await build_worker(config, kind))


def start_engine_worker(config: WorkerConfig, metrics: WorkerMetrics) -> WorkerContext:
    """Start a KV transport, load the model into an `Engine`, register its KV pool (in the engine
    device's memory) with the transport, give the engine its KV connector (the prefill side of the
    handoff, server_runtime/kv_send.py, or the decode side, server_runtime/kv_receive.py) and start the
    engine thread (a prefill or decode worker's
    runtime). The transport is asked first whether it can move that device's memory, so a worker
    that could never send or receive KV stops before it loads a model."""
    transport = create_transport(config.transport)
    try:
        transport.check_device(config.engine.device)
        engine = build_engine(config)
        facts, weights_id = EngineFacts.read(engine), engine.weights_id  # before the engine thread starts
        loras = LoraAdapters(config, engine.model_config) if config.engine.max_loras else None
        transport.register(facts.pool_base_addr, facts.pool_num_bytes, facts.pool_device)
    except BaseException:
        transport.close()
        raise
    metrics.torch_threads.set(config.torch_threads)
    loop = EngineLoop(engine, asyncio.get_running_loop(), metrics, thread_tuner(config))
    receiver = None
    if config.role == "decode":
        engine.kv_connector = receiver = KVReceiveConnector(config.reservation_ttl_s, config.write_grace_s)
    else:  # before the loop starts
        engine.kv_connector = KVSendConnector(transport, facts.pool_base_addr, loop.wake)
    engine.wake = loop.wake
    loop.start()
    return WorkerContext(config, loop, transport, facts, tandem.version(), weights_id, loras=loras, receiver=receiver)


def thread_tuner(config: WorkerConfig) -> ThreadTuner | None:
    """A decode worker on CPU with `max_torch_threads` above `torch_threads` picks between the two per step
    (server_runtime/threads.py); any other worker keeps `torch_threads`."""
    if config.role != "decode" or config.engine.device != "cpu" or config.max_torch_threads <= config.torch_threads:
        return None
    logger.info(
        "decode steps run on %d or %d torch threads, whichever their measured times favour",
        config.torch_threads,
        config.max_torch_threads,
    )
    return ThreadTuner(config.torch_threads, config.max_torch_threads)


def start_embedding_worker(config: WorkerConfig, metrics: WorkerMetrics) -> EmbeddingContext:
    """Load an embedding model (an embedding worker's runtime; it has no engine, so no engine metrics)."""
    _set_torch_threads(config)
    return start_embedding(config, tandem.version())


def build_engine(config: WorkerConfig) -> Engine:
    _set_torch_threads(config)
    use_device(config.engine.device)  # the model loads and the CUDA graphs are captured on this thread
    checkpoint = open_checkpoint(config.model_path)
    kv_store = None
    if config.kv_store is not None and config.engine.enable_prefix_cache:
        client = StoreClient(config.kv_store, config.transport.hostname)
        kv_store = StoreAccess(client, store_page_key(config.kv_grant_secret))
    background = None
    if config.engine.kv_disk_cache_dir is not None or kv_store is not None:  # slow tiers' I/O, off the engine thread
        # two threads: a prompt's read of cached pages does not wait behind a burst of disk writes
        background = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kv-tier-io").submit
    draft = open_checkpoint(config.draft_model_path) if config.draft_model_path else None
    return Engine(
        checkpoint, config.engine, faults=fault_hooks_from_env(), background=background, kv_store=kv_store, draft=draft
    )


def fault_hooks_from_env() -> FaultHooks:
    """The test fault hooks set in this process's environment (read here only, once); none when unset."""
    seed = os.environ.get(FAULT_NAN_LOGITS_SEED_ENV)
    if not seed:
        return FaultHooks()
    logger.warning("test fault hook on: requests with seed %s get NaN logits (%s)", seed, FAULT_NAN_LOGITS_SEED_ENV)
    return FaultHooks(nan_logits_seed=int(seed))


def _set_torch_threads(config: WorkerConfig) -> None:
    torch.set_num_threads(config.torch_threads)
    torch.set_flush_denormal(True)


def _grpc_server(config: WorkerConfig, metrics: WorkerMetrics) -> grpc.aio.Server:
    return grpc.aio.server(
        interceptors=[*config.credentials.server_interceptors(), metrics.interceptor()],
        options=[
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            # the gateway pings every 10 s, with or without calls (gateway/cluster/pool.py)
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
        ],
    )


def _add_health_and_reflection(server: grpc.aio.Server, service_names: tuple[str, ...]) -> health.aio.HealthServicer:
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    return health_servicer


def _listen(server: grpc.aio.Server, config: WorkerConfig) -> str:
    """Bind `config.host:config.port` (TLS when configured); returns the address with the bound port."""
    port = config.credentials.add_port(server, f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"cannot listen on {config.host}:{config.port}")
    return f"{config.host}:{port}"
