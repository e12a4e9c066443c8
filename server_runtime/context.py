"""What a worker's servicers get: `WorkerConfig`, and an engine worker's `WorkerContext` (the running
engine loop, the KV transport and `EngineFacts`). Below start-up (`worker.py`) and the servicers, so
both import it and it imports neither."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_pool import KVLayout
from engine.stats import EngineStats
from kv_transfer import KVTransport, TransportConfig
from server_runtime.engine_loop import EngineLoop
from tandem.internal_auth import InternalCredentials

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a prefill or decode server process needs."""

    role: str  # "prefill" or "decode"
    model_path: str
    host: str
    port: int  # 0: any free port (tests; `RunningWorker.address` tells which)
    engine: EngineConfig
    transport: TransportConfig  # its transfer_timeout_s: prefill's longest KV write before the request fails
    torch_threads: int
    reservation_ttl_s: float = 30.0  # decode: pages held for a prefill that never comes
    write_grace_s: float = 30.0  # decode: unused reservation pages rest this long before reuse
    is_embedding: bool = False  # prefill: serve Embed from an embedding model; no engine, KV or decode
    metrics_port: int = 0  # HTTP port serving Prometheus text; 0: no metrics endpoint
    credentials: InternalCredentials = InternalCredentials()  # the token (and TLS) every tandem.v1 call needs
    # Keys KV write grants (kv_grants.py); the workers' alone, never the gateway's. None: an open plane's public key.
    kv_grant_secret: str | None = field(default=None, repr=False)
    weights_dirs: tuple[str, ...] = ()  # UpdateWeights loads only from under these; (): the model's directory
    grammar_compile_timeout_s: float = 5.0  # a request's grammar that takes longer to compile is refused
    drain_timeout_s: float = 30.0  # on SIGTERM/SIGINT: longest wait for the requests in flight to finish

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
        if self.reservation_ttl_s <= 0 or self.write_grace_s < 0:
            raise ValueError("reservation_ttl_s must be positive, write_grace_s >= 0")
        if self.is_embedding and self.role != "prefill":
            raise ValueError("is_embedding is for prefill workers only: embeddings need no decode")
        if self.engine.device != "cpu" and not self.is_embedding:
            # The transports read and write the pool as host memory (memmove, Mooncake's CPU build): a
            # device pointer there would crash the process or move garbage.
            raise ValueError(
                f"KV transfer from {self.engine.device} memory is not supported yet: run prefill "
                "and decode workers with --device cpu (embedding workers may use a GPU)"
            )

    @property
    def kind_name(self) -> str:
        """The worker kind this config is for: "prefill", "decode" or "embedding"."""
        return "embedding" if self.is_embedding else self.role


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What an engine worker's servicers know of its engine: fixed from start-up on, read once
    before the engine thread starts (`read`), so no servicer touches the engine from the event loop."""

    architecture: str
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # sorted
    layout: KVLayout
    num_pages: int
    pool_base_addr: int  # the KV pool, as registered with the transport
    pool_num_bytes: int

    @classmethod
    def read(cls, engine: Engine) -> EngineFacts:
        """Read `engine`; only while no engine thread runs it."""
        pool = engine.runner.kv_pool
        return cls(
            architecture=engine.model_config.architecture.value,
            context_len=engine.context_len,
            vocab_size=engine.model_config.vocab_size,
            eos_token_ids=tuple(sorted(engine.eos_token_ids)),
            layout=engine.runner.layout,
            num_pages=pool.num_pages,
            pool_base_addr=pool.base_addr,
            pool_num_bytes=pool.num_bytes,
        )


@dataclass(slots=True)
class WorkerContext:
    """What a prefill or decode servicer gets: the config, the running engine loop (the only way to
    the engine), the KV transport and the engine's start-up facts."""

    config: WorkerConfig
    loop: EngineLoop
    transport: KVTransport
    facts: EngineFacts
    version: str
    weights_id: str  # the served weights; set from each UpdateWeights' result
    is_draining: bool = False  # shutting down: new requests (Reserve, Prefill) are refused, those in flight end

    @property
    def weights_dirs(self) -> tuple[str, ...]:
        """Where UpdateWeights may load from: --weights-dir, else the served model's directory."""
        if self.config.weights_dirs:
            return self.config.weights_dirs
        path = self.config.model_path
        return (path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)),)

    @property
    def description(self) -> str:
        return f"KV transport {self.config.transport.backend} at {self.transport.session_id}"

    async def stats(self) -> EngineStats:
        return await self.loop.call(Engine.stats)

    async def drain(self, deadline: float, stop: asyncio.Event) -> bool:
        """Refuse new requests, then wait until the engine holds nothing, `deadline` (monotonic)
        passes or `stop` is set. True when the engine is idle."""
        self.is_draining = True
        logger.info(
            "%s server draining: up to %g s for the requests in flight (--drain-timeout)",
            self.config.role,
            self.config.drain_timeout_s,
        )
        while not await self.loop.call(lambda engine: engine.is_idle):
            if stop.is_set() or time.monotonic() >= deadline:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _DRAIN_POLL_S)
        return True

    def close(self) -> None:
        self.loop.stop()
        self.transport.close()
