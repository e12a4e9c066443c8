"""The cluster's KV store, real: `tandem kv-store` (Mooncake's master and the store's memory) in a process of its
own, and workers' clients (`kv_transfer.mooncake_store.StoreClient`) under the engine's store tier
(`engine/kv_store_tier.py`).

It listens on its address only; a page one client puts, another reads back byte for byte; a page whose
tag does not verify (forged by a client without the workers' secret, put under another secret, cut
short) is dropped and counted, never copied into the pool; and a store that is not there, or dies, or
comes back, costs lookups a bounded wait and then misses: never an exception."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("mooncake.store", reason="Mooncake Store is not installed")

from engine.kv_pool import KVLayout, KVPool  # noqa: E402 - after the skip
from engine.kv_store_tier import TAG_BYTES, StoreTier, page_tag  # noqa: E402
from engine.prefix_cache import page_digest  # noqa: E402
from kv_transfer.mooncake_store import StoreClient  # noqa: E402
from tests.e2e.cluster_stack import free_port_run  # noqa: E402
from tests.e2e.stack import child_pids, free_port, is_alive  # noqa: E402
from tests.integration.test_mooncake_binding import listening_sockets  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
SECRET = b"s" * 32


@dataclass
class RunningStore:
    process: subprocess.Popen
    port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL, as a crash: the master goes with it (it dies with its parent)."""
        master = child_pids(self.process.pid)
        self.process.kill()
        self.process.wait(10)
        deadline = time.monotonic() + 10
        while any(is_alive(pid) for pid in master) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(is_alive(pid) for pid in master), "mooncake_master outlived the store"


def start_store(log: Path, port: int | None = None) -> RunningStore:
    port = port or free_port_run(2)  # the store's metrics listen on port + 1
    seen = log.stat().st_size if log.exists() else 0  # a restart appends to the same log
    process = subprocess.Popen(
        [sys.executable, "-m", "launcher", "kv-store", "--port", str(port), "--memory-gb", "0.25"],
        cwd=REPO_ROOT,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while b"KV store ready" not in log.read_bytes()[seen:]:
        assert process.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "the store did not start in 60 s"
        time.sleep(0.1)
    return RunningStore(process, port, log)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStore]:
    running = start_store(tmp_path_factory.mktemp("store") / "store.log")
    try:
        yield running
    finally:
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(20) == 0


def _connected(client: StoreClient) -> StoreClient:
    deadline = time.monotonic() + 20
    while not client.is_connected:
        assert time.monotonic() < deadline, "the client did not connect in 20 s"
        time.sleep(0.05)
    return client


def _pool() -> KVPool:
    pool = KVPool(LAYOUT, num_pages=8)
    pool.tensor.normal_()
    return pool


def test_the_store_and_its_master_listen_on_its_address_only(store: RunningStore) -> None:
    [master] = child_pids(store.process.pid)
    master_ports = listening_sockets(master)
    assert store.port in {port for _, port in master_ports}
    everything = master_ports + listening_sockets(store.process.pid)
    assert len(everything) >= 4  # RPC and metrics; the memory's transfer engine (handshake, data)
    assert {host for host, _ in everything} == {"127.0.0.1"}, everything


def test_a_page_one_worker_puts_another_reads_back(store: RunningStore) -> None:
    writer_pool, reader_pool = _pool(), _pool()
    writer = StoreTier(_connected(StoreClient(store.address, "127.0.0.1")), writer_pool, SECRET)
    reader = StoreTier(_connected(StoreClient(store.address, "127.0.0.1")), reader_pool, SECRET)
    digest = page_digest(b"root", [1, 2, 3, 4])
    gate = threading.Event()
    writer.store._puts.submit(gate.wait)  # hold the put lane: the put stays on its way
    writer.save(digest, 3)
    assert writer.num_pending == 1 and not reader.contains(digest)
    gate.set()
    writer.store.flush()
    assert writer.num_pending == 0
    assert reader.contains(digest) and reader.load(digest, 6)
    assert torch.equal(reader_pool.tensor[6], writer_pool.tensor[3])
    assert (writer.num_saved, reader.num_loaded, reader.num_dropped) == (1, 1, 0)
    assert not reader.contains(page_digest(b"root", [9, 9, 9, 9]))


def test_a_page_whose_tag_does_not_verify_is_dropped_not_served(store: RunningStore) -> None:
    pool = _pool()
    client = _connected(StoreClient(store.address, "127.0.0.1"))
    tier = StoreTier(client, pool, SECRET)
    before = pool.tensor[5].clone()
    payload = torch.zeros_like(pool.tensor[0]).view(torch.uint8).numpy().tobytes()
    forged = {  # what a party that reaches the store, but lacks the workers' secret, could put
        "signed with another secret": lambda d: page_tag(b"x" * 32, d, payload) + payload,
        "another page's tag": lambda d: page_tag(SECRET, page_digest(b"other", [0] * 4), payload) + payload,
        "cut short": lambda d: page_tag(SECRET, d, payload[:-4]) + payload[:-4],
        "no tag": lambda d: payload[:TAG_BYTES],
    }
    for n, value in enumerate(forged.values()):
        digest = page_digest(b"forged", [n] * 4)
        client.put(tier.key(digest), value(digest))
        client.flush()
        assert tier.contains(digest)  # there is something under its name ...
        assert not tier.load(digest, 5)  # ... that is never copied into the pool
    assert tier.num_dropped == len(forged) and tier.num_loaded == 0
    assert torch.equal(pool.tensor[5], before)


def test_a_lookup_with_no_answer_in_time_is_a_failure_and_the_store_is_away_for_a_while(store: RunningStore) -> None:
    writer = StoreTier(_connected(StoreClient(store.address, "127.0.0.1")), _pool(), SECRET)
    digest = page_digest(b"slow", [5] * 4)
    writer.save(digest, 1)
    writer.store.flush()
    client = _connected(StoreClient(store.address, "127.0.0.1", timeout_s=1e-9, retry_after_s=60))
    tier = StoreTier(client, _pool(), SECRET)
    assert not tier.contains(digest) and tier.num_failed == 1  # the page is there, but no answer in a nanosecond
    client.timeout_s = 10.0
    assert not tier.contains(digest) and tier.num_failed == 1  # away: a miss without asking
    assert writer.contains(digest)  # while a client that is not away finds it


def test_no_store_at_the_address_is_a_quick_miss(tmp_path: Path) -> None:
    client = StoreClient(f"127.0.0.1:{free_port()}", "127.0.0.1", retry_after_s=60)
    tier = StoreTier(client, _pool(), SECRET)
    started = time.monotonic()
    for n in range(20):
        digest = page_digest(b"r", [n] * 4)
        tier.save(digest, 0)
        assert not tier.contains(digest) and not tier.load(digest, 1)
    assert time.monotonic() - started < 2


def test_a_store_that_dies_costs_one_bounded_wait_then_misses_until_it_is_back(tmp_path: Path) -> None:
    running = start_store(tmp_path / "store.log")
    client = _connected(StoreClient(running.address, "127.0.0.1", timeout_s=0.25, retry_after_s=1.0))
    tier = StoreTier(client, _pool(), SECRET)
    digest = page_digest(b"d", [7] * 4)
    tier.save(digest, 2)
    client.flush()
    assert tier.contains(digest)
    running.kill()
    started = time.monotonic()
    for _ in range(20):
        assert not tier.contains(digest)
    assert time.monotonic() - started < 1.5  # one timed-out lookup; the rest miss at once
    assert tier.num_failed == client.num_failures  # a lookup that timed out, if one did (Mooncake often answers "none")

    again = start_store(tmp_path / "store.log", running.port)  # the same address, empty
    try:
        deadline = time.monotonic() + 30
        while True:  # Mooncake's client reconnects by itself once its master answers again
            tier.save(digest, 2)
            client.flush()
            if tier.contains(digest):
                break
            assert time.monotonic() < deadline, "the client did not come back to the restarted store"
            time.sleep(0.5)
        assert tier.load(digest, 4)
    finally:
        again.process.send_signal(signal.SIGTERM)
        again.process.wait(20)
