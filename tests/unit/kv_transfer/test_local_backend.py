"""The in-process transport (kv_transfer/local_backend.py) on torch pools shaped like a KV pool."""

import threading

import pytest
import torch

from kv_transfer import (
    KVTransferError,
    LocalTransport,
    RemotePages,
    TransportConfig,
    create_transport,
)

NUM_PAGES = 32
PAGE_SHAPE = (2, 4, 16)  # (k/v, kv heads, head_dim) for one token-page slice


def _pool(fill: str) -> torch.Tensor:
    shape = (NUM_PAGES, *PAGE_SHAPE)
    if fill == "random":
        return torch.randn(shape, dtype=torch.bfloat16)
    return torch.zeros(shape, dtype=torch.bfloat16)


def _page_bytes(pool: torch.Tensor) -> int:
    return pool[0].numel() * pool.element_size()


def _registered(pool: torch.Tensor) -> LocalTransport:
    transport = create_transport(TransportConfig(backend="local"))
    assert isinstance(transport, LocalTransport)
    transport.register(pool.data_ptr(), pool.numel() * pool.element_size())
    return transport


def _remote(transport: LocalTransport, pool: torch.Tensor, page_ids: list[int]) -> RemotePages:
    return RemotePages(session_id=transport.session_id, base_addr=pool.data_ptr(),
                       page_bytes=_page_bytes(pool), page_ids=tuple(page_ids))


def test_write_copies_pages_exactly_and_leaves_others_zero() -> None:
    src_pool, dst_pool = _pool("random"), _pool("zeros")
    with _registered(src_pool) as sender, _registered(dst_pool) as receiver:
        src_ids = [0, 1, 2, 7, 9, 10, 3]
        dst_ids = [5, 6, 7, 20, 1, 2, 30]
        stats = sender.write_pages(src_pool.data_ptr(), src_ids, _remote(receiver, dst_pool, dst_ids),
                                   timeout_s=1.0)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst_pool[d], src_pool[s])
    untouched = [p for p in range(NUM_PAGES) if p not in dst_ids]
    assert torch.count_nonzero(dst_pool[untouched]) == 0
    assert stats.num_bytes == len(src_ids) * _page_bytes(src_pool)
    assert stats.num_writes == 4  # runs: 0-2 -> 5-7, 3 -> 30, 7 -> 20, 9-10 -> 1-2
    assert stats.seconds >= 0.0


def test_session_ids_are_unique() -> None:
    with LocalTransport() as a, LocalTransport() as b:
        assert a.session_id != b.session_id
        assert a.session_id.startswith("local:")


def test_unknown_session_raises() -> None:
    src_pool = _pool("random")
    with _registered(src_pool) as sender:
        dst = RemotePages(session_id="local:nobody", base_addr=4096, page_bytes=_page_bytes(src_pool),
                          page_ids=(0,))
        with pytest.raises(KVTransferError, match="no local KV transport"):
            sender.write_pages(src_pool.data_ptr(), [0], dst, timeout_s=1.0)


def test_unregistered_source_raises_before_copying() -> None:
    src_pool, dst_pool = _pool("random"), _pool("zeros")
    with LocalTransport() as sender, _registered(dst_pool) as receiver:
        with pytest.raises(KVTransferError, match="source range"):
            sender.write_pages(src_pool.data_ptr(), [0], _remote(receiver, dst_pool, [0]), timeout_s=1.0)
    assert torch.count_nonzero(dst_pool) == 0


def test_destination_outside_peer_pool_raises_before_copying() -> None:
    src_pool, dst_pool = _pool("random"), _pool("zeros")
    with _registered(src_pool) as sender, _registered(dst_pool) as receiver:
        with pytest.raises(KVTransferError, match="destination on local:"):
            sender.write_pages(src_pool.data_ptr(), [0, 1], _remote(receiver, dst_pool, [3, NUM_PAGES]),
                               timeout_s=1.0)
    assert torch.count_nonzero(dst_pool) == 0


def test_length_mismatch_raises() -> None:
    src_pool, dst_pool = _pool("random"), _pool("zeros")
    with _registered(src_pool) as sender, _registered(dst_pool) as receiver:
        with pytest.raises(KVTransferError, match="source pages"):
            sender.write_pages(src_pool.data_ptr(), [0, 1, 2], _remote(receiver, dst_pool, [0, 1]),
                               timeout_s=1.0)
    assert torch.count_nonzero(dst_pool) == 0


def test_closed_transports_refuse_writes_in_both_directions() -> None:
    src_pool, dst_pool = _pool("random"), _pool("zeros")
    sender, receiver = _registered(src_pool), _registered(dst_pool)
    dst = _remote(receiver, dst_pool, [0])
    receiver.close()
    with pytest.raises(KVTransferError, match="no local KV transport"):
        sender.write_pages(src_pool.data_ptr(), [0], dst, timeout_s=1.0)
    sender.close()
    sender.close()  # idempotent
    with pytest.raises(KVTransferError, match="closed"):
        sender.write_pages(src_pool.data_ptr(), [0], dst, timeout_s=1.0)
    assert torch.count_nonzero(dst_pool) == 0


def test_invalid_timeout_raises() -> None:
    src_pool, dst_pool = _pool("random"), _pool("zeros")
    with _registered(src_pool) as sender, _registered(dst_pool) as receiver:
        with pytest.raises(KVTransferError, match="timeout_s"):
            sender.write_pages(src_pool.data_ptr(), [0], _remote(receiver, dst_pool, [0]), timeout_s=0)


def test_concurrent_writes_from_four_threads() -> None:
    src_pool, dst_pool = _pool("random"), _pool("zeros")
    errors: list[BaseException] = []
    with _registered(src_pool) as sender, _registered(dst_pool) as receiver:
        def worker(k: int) -> None:
            src_ids = [k * 8 + i for i in range(8)]
            dst_ids = [(31 - p) for p in src_ids]  # reversed: no run coalesces
            try:
                for _ in range(20):
                    dst = _remote(receiver, dst_pool, dst_ids)
                    sender.write_pages(src_pool.data_ptr(), src_ids, dst, timeout_s=1.0)
            except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []
    assert torch.equal(dst_pool, src_pool.flip(0))
