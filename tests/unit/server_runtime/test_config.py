"""WorkerConfig's checks that span the engine and the KV transport."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from kv_transfer import TransportConfig
from server_runtime.config import WorkerConfig


def _config(role: str, device: str, is_embedding: bool = False, transport: TransportConfig | None = None
            ) -> WorkerConfig:
    return WorkerConfig(role=role, model_path="/models/m", host="127.0.0.1", port=30001,
                        engine=EngineConfig(device=device), transport=transport or TransportConfig(backend="local"),
                        torch_threads=1, is_embedding=is_embedding)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_local_transport_keeps_a_kv_moving_worker_in_host_memory(role: str) -> None:
    assert _config(role, "cpu").engine.device == "cpu"
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=f"local KV transport copies host memory only, not {device}"):
            _config(role, device)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_mooncake_workers_may_keep_their_pool_on_a_gpu_over_tcp_or_rdma(role: str) -> None:
    """Whether the installed Mooncake is the CUDA build is checked when the transport starts
    (tests/unit/kv_transfer/test_mooncake_backend.py), not here."""
    tcp = TransportConfig(backend="mooncake")
    rdma = TransportConfig(backend="mooncake", protocol="rdma", device_name="mlx5_0,mlx5_1")
    assert _config(role, "cuda:1", transport=tcp).engine.device == "cuda:1"
    config = _config(role, "cuda", transport=rdma)
    assert (config.engine.device, config.transport.protocol, config.transport.device_name) == \
        ("cuda", "rdma", "mlx5_0,mlx5_1")


def test_an_embedding_worker_moves_no_kv_and_may_use_a_gpu() -> None:
    assert _config("prefill", "cuda", is_embedding=True).engine.device == "cuda"
