"""An engine worker's start-up order and what it registers with its KV transport (server_runtime/worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from kv_transfer import KVTransferError, TransportConfig
from server_runtime.config import WorkerConfig
from server_runtime.context import EngineFacts
from server_runtime.metrics import WorkerMetrics
from server_runtime.worker import build_engine, start_engine_worker
from tests.tiny_models import save_tiny_llama


def _config(model_path: str, device: str, backend: str) -> WorkerConfig:
    return WorkerConfig(role="decode", model_path=model_path, host="127.0.0.1", port=0,
                        engine=EngineConfig(dtype="float32", max_total_tokens=64, device=device),
                        transport=TransportConfig(backend=backend), torch_threads=1)


def test_a_gpu_worker_whose_mooncake_cannot_move_gpu_memory_stops_before_loading_a_model(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.engine")
    from kv_transfer.mooncake_backend import installed_build_moves_gpu_memory

    if installed_build_moves_gpu_memory():
        pytest.skip("the installed Mooncake is the CUDA build (make test-gpu), which takes GPU memory")
    missing = tmp_path / "no-such-model"   # loading it would fail otherwise: the transport's refusal comes first
    with pytest.raises(KVTransferError, match="CPU build .* cannot move cuda memory"):
        start_engine_worker(_config(str(missing), "cuda", "mooncake"), WorkerMetrics("decode", "m", "0"))


def test_the_pool_is_described_by_its_device_for_registration(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "tiny")
    engine = build_engine(_config(str(model), "cpu", "local"))
    facts = EngineFacts.read(engine)
    pool = engine.runner.kv_pool
    assert (facts.pool_base_addr, facts.pool_num_bytes, facts.pool_device) == (pool.base_addr, pool.num_bytes, "cpu")
