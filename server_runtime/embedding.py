"""The runtime of a prefill worker started with --is-embedding: an `Embedder` and the one thread it runs on.

An embedding worker has no `Engine`, KV pool or KV transport: each `Embed` call is one batch,
computed start to finish. The embedder is single-threaded, so calls run one after another on a
one-thread executor owned here (the embedding counterpart of `EngineLoop`'s thread); the gRPC
event loop only waits on them.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from engine.embedder import Embedder, load_embedder
from tandem.v1 import common_pb2

if TYPE_CHECKING:   # worker.py imports this module; the config type is all that is needed back
    from server_runtime.worker import WorkerConfig


@dataclass(frozen=True, slots=True)
class EmbedResult:
    vectors: torch.Tensor    # [num_inputs, dimensions] float32, rows in input order
    num_tokens: int
    queue_ms: float
    compute_ms: float


@dataclass(slots=True)
class EmbeddingContext:
    """What the embedding servicer gets: the config, the embedder and the thread it runs on."""

    config: WorkerConfig
    embedder: Embedder
    version: str
    _executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder"))
    _num_in_flight: int = 0   # Embed calls running or queued for the thread

    async def embed(self, token_lists: Sequence[Sequence[int]], dimensions: int | None) -> EmbedResult:
        """Embed one batch on the embedder thread; raises the embedder's `InvalidRequestError`s.

        A cancelled caller stops waiting, but a batch already running finishes on the thread.
        """
        submitted = time.perf_counter()
        started = submitted

        def run() -> torch.Tensor:
            nonlocal started
            started = time.perf_counter()
            return self.embedder.embed(token_lists, dimensions)

        self._num_in_flight += 1
        try:
            vectors = await asyncio.get_running_loop().run_in_executor(self._executor, run)
        finally:
            self._num_in_flight -= 1
        done = time.perf_counter()
        return EmbedResult(vectors, sum(len(t) for t in token_lists), (started - submitted) * 1000,
                           (done - started) * 1000)

    def model_info(self) -> common_pb2.GetModelInfoResponse:
        info = self.embedder.info
        return common_pb2.GetModelInfoResponse(
            model_path=self.config.model_path, architecture=info.architecture, context_len=info.context_len,
            vocab_size=info.vocab_size, role=common_pb2.WORKER_ROLE_PREFILL, version=self.version, is_embedding=True,
            embedding_dim=info.embedding_dim, is_matryoshka=info.is_matryoshka,
            matryoshka_dimensions=list(info.matryoshka_dimensions))

    async def load(self) -> common_pb2.GetLoadResponse:
        """Calls in flight: one running (on the thread), the rest waiting for it."""
        num_running = min(self._num_in_flight, 1)
        return common_pb2.GetLoadResponse(num_running=num_running, num_waiting=self._num_in_flight - num_running)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def start_embedding(config: WorkerConfig, version: str) -> EmbeddingContext:
    """Load the embedding model named by `config` (the caller has set torch's thread count)."""
    return EmbeddingContext(config, load_embedder(config.model_path, config.engine), version)
