"""The `KVTransport` contract (kv_transfer/base.py), run over both backends: `LocalTransport` and
`MooncakeTransport` over real Mooncake TCP on loopback (skipped where Mooncake is not installed).
What only one backend does is tested in its own file: tests/unit/kv_transfer/test_local_backend.py,
tests/integration/test_mooncake_transport.py."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from kv_transfer import KVTransferError, KVTransport, RemotePages, TransferStats, TransportConfig, create_transport
from tests.unit.kv_transfer.pools import NUM_PAGES, make_pool, page_bytes, pool_bytes

WAIT_S = 10.0
# A session id no transport answers to, per backend (port 1 refuses connections at once).
UNREACHABLE = {"local": "local:nobody", "mooncake": "127.0.0.1:1"}


@dataclass(frozen=True)
class Pair:
    """A sender and a receiver, each with its own registered pool."""

    backend: str
    src_pool: torch.Tensor
    sender: KVTransport
    dst_pool: torch.Tensor
    receiver: KVTransport

    def remote(self, page_ids: list[int], pool: torch.Tensor | None = None) -> RemotePages:
        """Pages of the receiver's pool (or of `pool`, at the receiver's session)."""
        pool = self.dst_pool if pool is None else pool
        return RemotePages(session_id=self.receiver.session_id, base_addr=pool.data_ptr(),
                           page_bytes=page_bytes(pool), page_ids=tuple(page_ids))

    def write(self, src_ids: list[int], dst: RemotePages, src_pool: torch.Tensor | None = None) -> TransferStats:
        pool = self.src_pool if src_pool is None else src_pool
        return self.sender.write_pages(pool.data_ptr(), src_ids, dst).result(timeout=WAIT_S)


def _registered(backend: str, pool: torch.Tensor) -> KVTransport:
    transport = create_transport(TransportConfig(backend=backend))
    transport.register(pool.data_ptr(), pool_bytes(pool))
    return transport


def _new_pair(backend: str) -> Pair:
    src_pool, dst_pool = make_pool(random=True), make_pool(random=False)
    return Pair(backend, src_pool, _registered(backend, src_pool), dst_pool, _registered(backend, dst_pool))


@pytest.fixture(scope="module", params=["local", "mooncake"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "mooncake":
        pytest.importorskip("mooncake.engine", reason="Mooncake transfer engine is not installed")
    return request.param


@pytest.fixture(scope="module")
def started_pair(backend: str) -> Iterator[Pair]:
    """Shared by the module: tearing a Mooncake engine down takes about a second."""
    pair = _new_pair(backend)
    yield pair
    pair.sender.close()
    pair.receiver.close()


@pytest.fixture
def pair(started_pair: Pair) -> Pair:
    """The shared pair with a fresh random source pool and a zeroed destination pool."""
    started_pair.src_pool.copy_(torch.randn_like(started_pair.src_pool))
    started_pair.dst_pool.zero_()
    return started_pair


@pytest.fixture
def own_pair(backend: str) -> Iterator[Pair]:
    """A pair private to one test, for tests that close transports."""
    pair = _new_pair(backend)
    yield pair
    pair.sender.close()
    pair.receiver.close()


def _failure(write: concurrent.futures.Future[TransferStats]) -> BaseException:
    error = write.exception(timeout=WAIT_S)
    assert isinstance(error, KVTransferError), error
    return error


def test_pages_land_exactly_and_untouched_pages_stay_zero(pair: Pair) -> None:
    src_ids = [0, 1, 2, 3, 10, 20, 21, 40, 41, 42, 63]
    dst_ids = [4, 5, 6, 7, 50, 30, 31, 0, 1, 9, 63]
    write = pair.sender.write_pages(pair.src_pool.data_ptr(), src_ids, pair.remote(dst_ids))
    assert isinstance(write, concurrent.futures.Future)
    stats = write.result(timeout=WAIT_S)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(pair.dst_pool[d], pair.src_pool[s]), f"page {s} -> {d}"
    untouched = [p for p in range(NUM_PAGES) if p not in dst_ids]
    assert torch.count_nonzero(pair.dst_pool[untouched]) == 0
    assert stats.num_bytes == len(src_ids) * page_bytes(pair.src_pool)
    assert stats.num_writes == 6  # 0-3 -> 4-7, 10, 20-21, 40-41 -> 0-1, 42 -> 9, 63
    assert stats.seconds >= 0.0


def test_session_ids_differ(pair: Pair) -> None:
    assert pair.sender.session_id != pair.receiver.session_id


def test_length_mismatch_fails_before_any_byte_moves(pair: Pair) -> None:
    error = _failure(pair.sender.write_pages(pair.src_pool.data_ptr(), [0, 1, 2], pair.remote([0, 1])))
    assert "3 source pages but 2 destination" in str(error)
    assert torch.count_nonzero(pair.dst_pool) == 0


def test_unregistered_source_fails_before_any_byte_moves(pair: Pair) -> None:
    stray = make_pool(random=True)
    error = _failure(pair.sender.write_pages(stray.data_ptr(), [0], pair.remote([0])))
    assert "source range" in str(error)
    assert torch.count_nonzero(pair.dst_pool) == 0


def test_destination_outside_the_peers_registration_is_refused(pair: Pair) -> None:
    unregistered = make_pool(random=False)
    _failure(pair.sender.write_pages(pair.src_pool.data_ptr(), [0, 1], pair.remote([0, 1], unregistered)))
    assert torch.count_nonzero(unregistered) == 0


def test_a_peer_no_one_answers_to_fails(pair: Pair) -> None:
    dst = RemotePages(session_id=UNREACHABLE[pair.backend], base_addr=1 << 20, page_bytes=page_bytes(pair.src_pool),
                      page_ids=(0,))
    _failure(pair.sender.write_pages(pair.src_pool.data_ptr(), [0], dst))


def test_closed_peer_and_closed_sender_fail(own_pair: Pair) -> None:
    dst = own_pair.remote([0])
    own_pair.write([5], dst)
    own_pair.dst_pool.zero_()
    own_pair.receiver.close()
    _failure(own_pair.sender.write_pages(own_pair.src_pool.data_ptr(), [5], dst))
    assert torch.count_nonzero(own_pair.dst_pool) == 0
    own_pair.sender.close()
    own_pair.sender.close()  # idempotent
    error = _failure(own_pair.sender.write_pages(own_pair.src_pool.data_ptr(), [5], dst))
    assert "closed" in str(error)


def test_concurrent_writes_from_four_threads(pair: Pair) -> None:
    errors: list[BaseException] = []
    num_bytes: list[int] = []

    def worker(k: int) -> None:
        src_ids = [k * 16 + i for i in range(16)]
        dst_ids = [NUM_PAGES - 1 - p for p in src_ids]  # reversed: no run coalesces
        try:
            for _ in range(10):
                num_bytes.append(pair.write(src_ids, pair.remote(dst_ids)).num_bytes)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert num_bytes == [16 * page_bytes(pair.src_pool)] * 40
    assert torch.equal(pair.dst_pool, pair.src_pool.flip(0))
