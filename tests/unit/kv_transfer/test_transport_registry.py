"""Config validation, `RemotePages` validation and the backend registry (kv_transfer/base.py)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ConfigError
from kv_transfer import (
    KVTransferError,
    LocalTransport,
    RemotePages,
    TransferStats,
    TransportConfig,
    available_transports,
    create_transport,
    register_transport,
)
from kv_transfer.base import check_timeout

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_default_config_is_mooncake_over_tcp_on_loopback() -> None:
    config = TransportConfig()
    assert (config.backend, config.hostname, config.protocol, config.device_name) == (
        "mooncake", "127.0.0.1", "tcp", "")


@pytest.mark.parametrize("kwargs, message", [
    ({"backend": " "}, "backend"),
    ({"hostname": ""}, "hostname"),
    ({"hostname": "a b"}, "hostname"),
    ({"protocol": "udp"}, "protocol"),
    ({"protocol": "tcp", "device_name": "mlx5_0"}, "device_name"),
    ({"transfer_timeout_s": 0}, "transfer_timeout_s"),
    ({"transfer_timeout_s": float("inf")}, "transfer_timeout_s"),
])
def test_invalid_config_raises_config_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TransportConfig(**kwargs)


def test_rdma_config_accepts_device_names() -> None:
    assert TransportConfig(protocol="rdma", device_name="mlx5_0,mlx5_1").device_name == "mlx5_0,mlx5_1"


def test_remote_pages_normalises_and_validates() -> None:
    page_ids: list[int] = [3, 1]
    pages = RemotePages(session_id="h:1", base_addr=4096, page_bytes=64,
                        page_ids=page_ids)  # type: ignore[arg-type]
    assert pages.page_ids == (3, 1)
    for kwargs in ({"session_id": ""}, {"base_addr": 0}, {"page_bytes": 0},
                   {"page_ids": (-1,)}, {"page_ids": (2, 2)}):
        fields = {"session_id": "h:1", "base_addr": 4096, "page_bytes": 64, "page_ids": (0,)} | kwargs
        with pytest.raises(KVTransferError):
            RemotePages(**fields)


def test_transfer_stats_throughput() -> None:
    assert TransferStats(num_bytes=1000, seconds=0.5, num_writes=2).bytes_per_second == 2000.0
    assert TransferStats(num_bytes=0, seconds=0.0, num_writes=0).bytes_per_second == 0.0


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, math.inf, math.nan])
def test_check_timeout_rejects_non_positive_or_non_finite(timeout_s: float) -> None:
    with pytest.raises(KVTransferError, match="timeout_s"):
        check_timeout(timeout_s)


def test_importing_the_package_registers_both_backends_but_not_mooncake() -> None:
    probe = ("import sys, kv_transfer; "
             "print(sorted(kv_transfer.available_transports()), 'mooncake' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            cwd=REPO_ROOT, check=True)
    assert result.stdout.strip() == "['local', 'mooncake'] False"


def test_create_transport_builds_the_named_backend() -> None:
    assert {"local", "mooncake"} <= set(available_transports())
    transport = create_transport(TransportConfig(backend="local"))
    try:
        assert isinstance(transport, LocalTransport)
    finally:
        transport.close()


def test_unknown_backend_lists_known_ones() -> None:
    expected = r"unknown KV transport backend 'nccl'; known: .*local.*mooncake"
    with pytest.raises(KVTransferError, match=expected):
        create_transport(TransportConfig(backend="nccl"))


def test_registering_a_different_class_under_a_taken_name_raises() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_transport("local")(object)  # type: ignore[arg-type]
