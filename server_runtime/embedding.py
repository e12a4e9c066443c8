"""The runtime of a prefill worker started with --is-embedding: an `Embedder` on one lane of the
process's `BlockingWork`.

An embedding worker has no `Engine`, KV pool or KV transport: each `Embed` call is one batch,
computed start to finish. The embedder is single-threaded, so calls run one after another on a
`Lane` (the embedding counterpart of `EngineLoop`'s thread); the gRPC event loop only waits on them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.embedder import Embedder, EmbeddingModelInfo, load_embedder
from engine.stats import EngineStats
from server_runtime.blocking import BlockingWork, Lane
from server_runtime.config import WorkerConfig


@dataclass(frozen=True, slots=True)
class EmbedResult:
    vectors: torch.Tensor  # [num_inputs, dimensions] float32, rows in input order
    num_tokens: int
    queue_ms: float
    compute_ms: float


@dataclass(slots=True)
class EmbeddingContext:
    """What the embedding servicers get: the config, the embedder's model info, and `embed`, which
    runs the embedder on its lane of `work` (owned here: `close` ends it)."""

    config: WorkerConfig
    embedder: Embedder
    work: BlockingWork
    version: str
    info: EmbeddingModelInfo = field(init=False)
    _lane: Lane = field(init=False)
    _num_in_flight: int = 0  # Embed calls running or queued for the lane

    def __post_init__(self) -> None:
        self.info = self.embedder.info
        self._lane = self.work.lane()

    @property
    def description(self) -> str:
        return "no KV transport: embeddings only"

    async def embed(
        self,
        token_lists: Sequence[Sequence[int]],
        dimensions: int | None,
        token_type_lists: Sequence[Sequence[int]] | None = None,
    ) -> EmbedResult:
        """Embed one batch on the embedder's lane (`token_type_lists`: each input's segments, None:
        all 0); raises the embedder's `InvalidRequestError`s.

        A cancelled caller stops waiting, but a batch already running finishes on its thread.
        """
        submitted = time.perf_counter()
        started = submitted

        def run() -> torch.Tensor:
            nonlocal started
            started = time.perf_counter()
            return self.embedder.embed(token_lists, dimensions, token_type_lists)

        self._num_in_flight += 1
        try:
            vectors = await self._lane.run(run)
        finally:
            self._num_in_flight -= 1
        done = time.perf_counter()
        return EmbedResult(
            vectors, sum(len(t) for t in token_lists), (started - submitted) * 1000, (done - started) * 1000
        )

    def stats(self) -> EngineStats:
        """Calls in flight: one running (on the lane), the rest waiting for it; no pages."""
        num_running = min(self._num_in_flight, 1)
        return EngineStats(
            num_running=num_running,
            num_waiting=self._num_in_flight - num_running,
            num_free_pages=0,
            num_total_pages=0,
            num_cached_pages=0,
            num_preemptions=0,
        )

    async def drain(self, deadline: float, stop: asyncio.Event) -> bool:
        """Nothing to wait for here: the gRPC server's grace covers the Embed calls in flight."""
        return True

    def close(self) -> None:
        self.work.close()


def start_embedding(config: WorkerConfig, version: str) -> EmbeddingContext:
    """Load the embedding model named by `config` (the caller has set torch's thread count). Call
    from the event loop the worker serves on."""
    embedder = load_embedder(config.model_path, config.engine)
    return EmbeddingContext(config, embedder, BlockingWork(asyncio.get_running_loop()), version)
