"""Real prefill and decode workers in this process, for tests that need both ends of a handoff.

`running_workers(model_path)` builds both with `build_worker` (the PREFILL and DECODE kinds) on
loopback, any free ports, with a `LocalTransport` between them (both pools live in this process), and
closes them on exit:

    async with running_workers(save_tiny_qwen2(tmp_path / "m")) as workers:
        pool = WorkerPool((workers.prefill.address,), (workers.decode.address,))

Each `RunningWorker` also gives its runtime (`.context`: config, engine loop, transport, facts).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decode_server.servicer import DECODE
from engine.config import EngineConfig
from kv_transfer import TransportConfig
from prefill_server.servicer import PREFILL
from server_runtime.context import WorkerConfig, WorkerContext
from server_runtime.worker import RunningWorker, build_worker

ENGINE = EngineConfig(dtype="float32", max_total_tokens=1024)


@dataclass(frozen=True)
class Workers:
    prefill: RunningWorker[WorkerContext]
    decode: RunningWorker[WorkerContext]


def worker_config(model_path: str | Path, role: str, **overrides: Any) -> WorkerConfig:
    """A `role` worker's config for an in-process test: float32, a 1024-token pool (prefix cache on, as
    `tandem prefill` and `tandem decode` have it), port 0, a local transport, torch's thread count as it is.
    `overrides` replace any WorkerConfig field."""
    fields: dict[str, Any] = dict(
        role=role, model_path=str(model_path), host="127.0.0.1", port=0,
        engine=dataclasses.replace(ENGINE, enable_prefix_cache=True),
        transport=TransportConfig(backend="local"), torch_threads=torch.get_num_threads())
    return WorkerConfig(**{**fields, **overrides})


@contextlib.asynccontextmanager
async def running_workers(model_path: str | Path, **overrides: Any) -> AsyncIterator[Workers]:
    """A prefill and a decode worker serving `model_path` until the block ends (then closed, calls in
    flight cancelled). `overrides` go to both configs (see `worker_config`)."""
    prefill = await build_worker(worker_config(model_path, "prefill", **overrides), PREFILL)
    try:
        decode = await build_worker(worker_config(model_path, "decode", **overrides), DECODE)
        try:
            yield Workers(prefill, decode)
        finally:
            await decode.close()
    finally:
        await prefill.close()
