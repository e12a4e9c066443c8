"""What only the Mooncake transport does, with real transports on loopback (TCP, P2P handshake): its
session ids, a large write, failing fast, and a stalled peer. The behaviour every transport shares is
in tests/unit/kv_transfer/test_transport_contract.py. Skips itself where Mooncake is not installed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("mooncake.engine", reason="Mooncake transfer engine is not installed")

from kv_transfer import (  # noqa: E402 - after the skip
    KVTransferError,
    KVTransferTimeout,
    MooncakeTransport,
    RemotePages,
    TransportConfig,
    create_transport,
)
from engine.request import Request, SamplingParams  # noqa: E402
from server_runtime.kv_send import KVSend, KVSendConnector, await_write  # noqa: E402
from tests.e2e.stack import wait_until_stopped  # noqa: E402
from tests.unit.kv_transfer.pools import make_pool, page_bytes, pool_bytes  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


def _start(pool: torch.Tensor) -> MooncakeTransport:
    transport = create_transport(TransportConfig(backend="mooncake"))
    assert isinstance(transport, MooncakeTransport)
    transport.register(pool.data_ptr(), pool_bytes(pool))
    return transport


def _remote(session_id: str, pool: torch.Tensor, page_ids: list[int]) -> RemotePages:
    return RemotePages(session_id=session_id, base_addr=pool.data_ptr(), page_bytes=page_bytes(pool),
                       page_ids=tuple(page_ids))


Pair = tuple[torch.Tensor, MooncakeTransport, torch.Tensor, MooncakeTransport]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    """Engines are shared by the module because tearing one down takes about a second."""
    src_pool, dst_pool = make_pool(random=True), make_pool(random=False)
    sender, receiver = _start(src_pool), _start(dst_pool)
    yield src_pool, sender, dst_pool, receiver
    sender.close()
    receiver.close()


def test_session_id_is_host_and_rpc_port(pair: Pair) -> None:
    _, sender, _, receiver = pair
    host, port = sender.session_id.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert sender.session_id != receiver.session_id


def test_a_kv_host_given_by_name_is_advertised_by_its_address() -> None:
    """Peers dial the session id: a name shared by several replicas (each resolving it to itself) must
    not reach them, so the address this machine listens on is what they get."""
    with create_transport(TransportConfig(backend="mooncake", hostname="localhost")) as transport:
        host, port = transport.session_id.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0


def test_the_cpu_build_refuses_gpu_memory_before_registering_it(pair: Pair) -> None:
    """With Mooncake's CPU wheel, a pool on a GPU is refused with the wheel to install, and nothing is
    registered (the same host pool registers as before)."""
    from mooncake.engine import TransferEngine

    from kv_transfer.mooncake_backend import installed_build_moves_gpu_memory, moves_gpu_memory

    if installed_build_moves_gpu_memory():
        pytest.skip("the CUDA build is installed (make test-gpu): tests/gpu/test_mooncake_gpu.py covers it")
    assert not moves_gpu_memory(TransferEngine)
    _, sender, _, _ = pair
    sender.check_device("cpu")
    for device in ("cuda", "cuda:1"):
        with pytest.raises(KVTransferError, match=f"CPU build .* cannot move {device} memory") as info:
            sender.check_device(device)
        assert "`mooncake-transfer-engine`" in str(info.value)
    spare = make_pool(random=False, num_pages=4)
    with pytest.raises(KVTransferError, match="CPU build"):
        sender.register(spare.data_ptr(), pool_bytes(spare), "cuda:0")
    assert len(sender._regions.snapshot()) == 1          # the pair's own pool only
    sender.register(spare.data_ptr(), pool_bytes(spare), "cpu")
    assert [r.device for r in sender._regions.snapshot()] == ["cpu", "cpu"]


def test_large_single_run_write() -> None:
    src_pool = torch.randn(256, 64, 256, dtype=torch.bfloat16)
    dst_pool = torch.zeros_like(src_pool)
    with _start(src_pool) as sender, _start(dst_pool) as receiver:
        ids = list(range(256))  # 8 MiB in one contiguous write
        stats = sender.write_pages(src_pool.data_ptr(), ids,
                                   _remote(receiver.session_id, dst_pool, ids)).result(timeout=10.0)
    assert torch.equal(dst_pool, src_pool)
    assert (stats.num_bytes, stats.num_writes) == (8 << 20, 1)
    assert stats.bytes_per_second > 0


def test_unreachable_peer_fails_quickly(pair: Pair) -> None:
    src_pool, sender, _, _ = pair
    dst = RemotePages(session_id="127.0.0.1:1", base_addr=1 << 20, page_bytes=page_bytes(src_pool),
                      page_ids=(0,))
    start = time.monotonic()
    with pytest.raises(KVTransferError) as info:
        sender.write_pages(src_pool.data_ptr(), [0], dst).result(timeout=10.0)
    assert not isinstance(info.value, KVTransferTimeout)
    assert time.monotonic() - start < 2.0


_PEER_SCRIPT = """
import sys, time, torch
from kv_transfer import TransportConfig, create_transport
pool = torch.zeros(64, 2, 4, 16, dtype=torch.bfloat16)
transport = create_transport(TransportConfig(backend="mooncake"))
transport.register(pool.data_ptr(), pool.numel() * pool.element_size())
print(transport.session_id, pool.data_ptr(), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("handshake_first", [True, False],
                         ids=["stalled-mid-session", "stalled-before-handshake"])
def test_stalled_peer_times_out_instead_of_hanging(pair: Pair, handshake_first: bool) -> None:
    """A SIGSTOPped peer accepts TCP connections but never answers; Mooncake would wait 30-60 s.
    `write_pages` returns at once all the same, and the KV connector gives up at its deadline."""
    src_pool, sender, _, _ = pair
    peer = subprocess.Popen([sys.executable, "-c", _PEER_SCRIPT], cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert peer.stdout is not None
        session_id, base_addr = peer.stdout.readline().split()
        dst = RemotePages(session_id=session_id, base_addr=int(base_addr),
                          page_bytes=page_bytes(src_pool), page_ids=(0, 1))
        if handshake_first:
            sender.write_pages(src_pool.data_ptr(), [0, 1], dst).result(timeout=5.0)
        os.kill(peer.pid, signal.SIGSTOP)
        wait_until_stopped(peer.pid)
        start = time.monotonic()
        write = sender.write_pages(src_pool.data_ptr(), [2, 3], dst)
        assert time.monotonic() - start < 1.0 and not write.done()   # it never waits for the peer
        # the prefill side's KV connector: its wait gives up at the deadline, and so does its hold on the pages
        connector = KVSendConnector(sender, src_pool.data_ptr())
        send = KVSend(dst, 0, int((time.time() + 60) * 1000), timeout_s=0.5)
        assert connector.on_finished(Request("stalled", [1], SamplingParams(), page_ids=[2, 3], kv_params=send))
        start = time.monotonic()
        connector.start_saves()
        assert connector.poll().sent == []
        with pytest.raises(KVTransferTimeout, match="within 0.5 s"):
            asyncio.run(await_write(send))
        assert 0.5 <= time.monotonic() - start < 1.5
        assert not write.done() and not send.written.done()
        assert connector.poll().sent == ["stalled"] and connector.num_running == 0
    finally:
        peer.kill()
        peer.wait(timeout=10)
