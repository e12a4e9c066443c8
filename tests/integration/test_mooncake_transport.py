"""Two real Mooncake transports on loopback (TCP, P2P handshake) moving pages between torch pools
shaped like KV pools. Skips itself where Mooncake is not installed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
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

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_PAGES = 64
PAGE_SHAPE = (2, 4, 16)


def _pool(random: bool) -> torch.Tensor:
    shape = (NUM_PAGES, *PAGE_SHAPE)
    make = torch.randn if random else torch.zeros
    return make(shape, dtype=torch.bfloat16)


def _page_bytes(pool: torch.Tensor) -> int:
    return pool[0].numel() * pool.element_size()


def _start(pool: torch.Tensor) -> MooncakeTransport:
    transport = create_transport(TransportConfig(backend="mooncake"))
    assert isinstance(transport, MooncakeTransport)
    transport.register(pool.data_ptr(), pool.numel() * pool.element_size())
    return transport


def _remote(session_id: str, pool: torch.Tensor, page_ids: list[int]) -> RemotePages:
    return RemotePages(session_id=session_id, base_addr=pool.data_ptr(), page_bytes=_page_bytes(pool),
                       page_ids=tuple(page_ids))


Pair = tuple[torch.Tensor, MooncakeTransport, torch.Tensor, MooncakeTransport]


@pytest.fixture(scope="module")
def started_pair() -> Iterator[Pair]:
    """Engines are shared by the module because tearing one down takes about a second."""
    src_pool, dst_pool = _pool(random=True), _pool(random=False)
    sender, receiver = _start(src_pool), _start(dst_pool)
    yield src_pool, sender, dst_pool, receiver
    sender.close()
    receiver.close()


@pytest.fixture
def pair(started_pair: Pair) -> Pair:
    """(fresh random source pool, sender, zeroed destination pool, receiver), both registered."""
    src_pool, _, dst_pool, _ = started_pair
    src_pool.copy_(torch.randn_like(src_pool))
    dst_pool.zero_()
    return started_pair


@pytest.fixture
def own_pair() -> Iterator[Pair]:
    """A pair private to one test, for tests that close transports."""
    src_pool, dst_pool = _pool(random=True), _pool(random=False)
    sender, receiver = _start(src_pool), _start(dst_pool)
    yield src_pool, sender, dst_pool, receiver
    sender.close()
    receiver.close()


def test_session_id_is_host_and_rpc_port(pair: Pair) -> None:
    _, sender, _, receiver = pair
    host, port = sender.session_id.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert sender.session_id != receiver.session_id


def test_pages_land_exactly_and_untouched_pages_stay_zero(pair: Pair) -> None:
    src_pool, sender, dst_pool, receiver = pair
    src_ids = [0, 1, 2, 3, 10, 20, 21, 40, 41, 42, 63]
    dst_ids = [4, 5, 6, 7, 50, 30, 31, 0, 1, 9, 63]
    dst = _remote(receiver.session_id, dst_pool, dst_ids)
    stats = sender.write_pages(src_pool.data_ptr(), src_ids, dst, timeout_s=5.0)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst_pool[d], src_pool[s]), f"page {s} -> {d}"
    untouched = [p for p in range(NUM_PAGES) if p not in dst_ids]
    assert torch.count_nonzero(dst_pool[untouched]) == 0
    assert stats.num_bytes == len(src_ids) * _page_bytes(src_pool)
    assert stats.num_writes == 6  # 0-3 -> 4-7, 10, 20-21, 40-41 -> 0-1, 42 -> 9, 63
    assert stats.seconds > 0


def test_large_single_run_write() -> None:
    src_pool = torch.randn(256, 64, 256, dtype=torch.bfloat16)
    dst_pool = torch.zeros_like(src_pool)
    with _start(src_pool) as sender, _start(dst_pool) as receiver:
        ids = list(range(256))  # 8 MiB in one contiguous write
        stats = sender.write_pages(src_pool.data_ptr(), ids, _remote(receiver.session_id, dst_pool, ids),
                                   timeout_s=10.0)
    assert torch.equal(dst_pool, src_pool)
    assert (stats.num_bytes, stats.num_writes) == (8 << 20, 1)
    assert stats.bytes_per_second > 0


def test_concurrent_writes_from_four_threads(pair: Pair) -> None:
    src_pool, sender, dst_pool, receiver = pair
    errors: list[BaseException] = []
    num_bytes: list[int] = []

    def worker(k: int) -> None:
        src_ids = [k * 16 + i for i in range(16)]
        dst_ids = [NUM_PAGES - 1 - p for p in src_ids]
        try:
            for _ in range(10):
                dst = _remote(receiver.session_id, dst_pool, dst_ids)
                stats = sender.write_pages(src_pool.data_ptr(), src_ids, dst, timeout_s=10.0)
                num_bytes.append(stats.num_bytes)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert num_bytes == [16 * _page_bytes(src_pool)] * 40
    assert torch.equal(dst_pool, src_pool.flip(0))


def test_unreachable_peer_raises_quickly(pair: Pair) -> None:
    src_pool, sender, _, _ = pair
    dst = RemotePages(session_id="127.0.0.1:1", base_addr=1 << 20, page_bytes=_page_bytes(src_pool),
                      page_ids=(0,))
    start = time.monotonic()
    with pytest.raises(KVTransferError) as info:
        sender.write_pages(src_pool.data_ptr(), [0], dst, timeout_s=10.0)
    assert not isinstance(info.value, KVTransferTimeout)
    assert time.monotonic() - start < 2.0


def test_length_mismatch_raises(pair: Pair) -> None:
    src_pool, sender, dst_pool, receiver = pair
    with pytest.raises(KVTransferError, match="3 source pages but 2 destination"):
        dst = _remote(receiver.session_id, dst_pool, [0, 1])
        sender.write_pages(src_pool.data_ptr(), [0, 1, 2], dst, timeout_s=5.0)
    assert torch.count_nonzero(dst_pool) == 0


def test_unregistered_source_is_refused(pair: Pair) -> None:
    _, sender, dst_pool, receiver = pair
    stray = _pool(random=True)
    with pytest.raises(KVTransferError, match="source range"):
        dst = _remote(receiver.session_id, dst_pool, [0])
        sender.write_pages(stray.data_ptr(), [0], dst, timeout_s=5.0)
    assert torch.count_nonzero(dst_pool) == 0


def test_destination_outside_peer_registration_is_rejected_by_peer(pair: Pair) -> None:
    src_pool, sender, _, receiver = pair
    unregistered = _pool(random=False)
    with pytest.raises(KVTransferError, match="failed"):
        dst = _remote(receiver.session_id, unregistered, [0, 1])
        sender.write_pages(src_pool.data_ptr(), [0, 1], dst, timeout_s=5.0)
    assert torch.count_nonzero(unregistered) == 0


def test_closed_peer_and_closed_sender_raise(own_pair: Pair) -> None:
    src_pool, sender, dst_pool, receiver = own_pair
    dst = _remote(receiver.session_id, dst_pool, [0])
    sender.write_pages(src_pool.data_ptr(), [5], dst, timeout_s=5.0)
    dst_pool.zero_()
    receiver.close()
    with pytest.raises(KVTransferError):
        sender.write_pages(src_pool.data_ptr(), [5], dst, timeout_s=5.0)
    assert torch.count_nonzero(dst_pool) == 0
    sender.close()
    with pytest.raises(KVTransferError, match="closed"):
        sender.write_pages(src_pool.data_ptr(), [5], dst, timeout_s=5.0)


_PEER_SCRIPT = """
import sys, time, torch
from kv_transfer import TransportConfig, create_transport
pool = torch.zeros(64, 2, 4, 16, dtype=torch.bfloat16)
transport = create_transport(TransportConfig(backend="mooncake"))
transport.register(pool.data_ptr(), pool.numel() * pool.element_size())
print(transport.session_id, pool.data_ptr(), flush=True)
time.sleep(600)
"""


def _wait_until_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP is delivered to each thread as it next runs; under load a thread may still answer a
    request right after os.kill. Wait until every thread of `pid` reports state T (stopped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not stop within {timeout_s} s")


@pytest.mark.parametrize("handshake_first", [True, False],
                         ids=["stalled-mid-session", "stalled-before-handshake"])
def test_stalled_peer_times_out_instead_of_hanging(pair: Pair, handshake_first: bool) -> None:
    """A SIGSTOPped peer accepts TCP connections but never answers; Mooncake would wait 30-60 s."""
    src_pool, sender, _, _ = pair
    peer = subprocess.Popen([sys.executable, "-c", _PEER_SCRIPT], cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert peer.stdout is not None
        session_id, base_addr = peer.stdout.readline().split()
        dst = RemotePages(session_id=session_id, base_addr=int(base_addr),
                          page_bytes=_page_bytes(src_pool), page_ids=(0, 1))
        if handshake_first:
            sender.write_pages(src_pool.data_ptr(), [0, 1], dst, timeout_s=5.0)
        os.kill(peer.pid, signal.SIGSTOP)
        _wait_until_stopped(peer.pid)
        start = time.monotonic()
        with pytest.raises(KVTransferTimeout, match="within 0.5 s"):
            sender.write_pages(src_pool.data_ptr(), [2, 3], dst, timeout_s=0.5)
        assert 0.5 <= time.monotonic() - start < 1.5
    finally:
        peer.kill()
        peer.wait(timeout=10)
