"""What an engine worker's servicers get: `WorkerContext` (its `WorkerConfig`, the running engine loop,
the KV transport and `EngineFacts`). Below start-up (`worker.py`) and the servicers, so both import it
and it imports neither."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass

from engine.engine import Engine
from engine.kv_pool import KVLayout
from engine.models.registry import implementation_of
from engine.stats import EngineStats
from kv_transfer import KVTransport
from server_runtime.config import WorkerConfig
from server_runtime.engine_loop import EngineLoop
from server_runtime.kv_receive import KVReceiveConnector
from server_runtime.lora_serving import LoraAdapters

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What an engine worker's servicers know of its engine: fixed from start-up on, read once
    before the engine thread starts (`read`), so no servicer touches the engine from the event loop."""

    architecture: str
    implementation: str  # whose modeling code runs it: "tandem" or "transformers" (engine.models.registry)
    context_len: int
    vocab_size: int
    num_attention_heads: int
    eos_token_ids: tuple[int, ...]  # sorted
    layout: KVLayout
    num_pages: int
    pool_base_addr: int  # the KV pool, as registered with the transport
    pool_num_bytes: int
    pool_device: str  # whose memory the pool is in: "cpu" or "cuda:<n>" (the base address is then a device pointer)

    @classmethod
    def read(cls, engine: Engine) -> EngineFacts:
        """Read `engine`; only while no engine thread runs it."""
        pool = engine.runner.kv_pool
        architecture = engine.model_config.architecture
        implementation = implementation_of(architecture)
        logger.info("%s runs on %s's modeling code", architecture, implementation.capitalize())
        return cls(
            architecture=architecture,
            implementation=implementation,
            context_len=engine.context_len,
            vocab_size=engine.model_config.vocab_size,
            num_attention_heads=engine.model_config.num_heads,
            eos_token_ids=tuple(sorted(engine.eos_token_ids)),
            layout=engine.runner.layout,
            num_pages=pool.num_pages,
            pool_base_addr=pool.base_addr,
            pool_num_bytes=pool.num_bytes,
            pool_device=str(pool.device),
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
    # shutting down: new requests (Reserve, Prefill, PrefillAndGenerate) are refused, those in flight end
    is_draining: bool = False
    loras: LoraAdapters | None = None  # the LoRA adapters it serves (None: --max-loras 0)
    # a decode worker's KV connector (touched on the engine thread only); None on a prefill worker
    receiver: KVReceiveConnector | None = None

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
        await self.loop.end_kv_events()  # subscribers' streams end now, not at the server's grace
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
