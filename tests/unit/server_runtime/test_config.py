"""WorkerConfig's checks that span the engine and the KV transport."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from kv_transfer import TransportConfig
from server_runtime.config import WorkerConfig


def _config(role: str, device: str, is_embedding: bool = False) -> WorkerConfig:
    return WorkerConfig(role=role, model_path="/models/m", host="127.0.0.1", port=30001,
                        engine=EngineConfig(device=device), transport=TransportConfig(backend="local"),
                        torch_threads=1, is_embedding=is_embedding)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kv_moving_workers_keep_their_pool_in_host_memory_for_now(role: str) -> None:
    assert _config(role, "cpu").engine.device == "cpu"
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=f"KV transfer from {device} memory is not supported yet"):
            _config(role, device)


def test_an_embedding_worker_moves_no_kv_and_may_use_a_gpu() -> None:
    assert _config("prefill", "cuda", is_embedding=True).engine.device == "cuda"
