"""What only the in-process transport (kv_transfer/local_backend.py) does; the behaviour every
transport shares is in test_transport_contract.py."""

import pytest
import torch

from kv_transfer import KVTransferError, LocalTransport, RemotePages, TransportConfig, create_transport
from tests.unit.kv_transfer.pools import make_pool, page_bytes, pool_bytes


def _registered(pool: torch.Tensor) -> LocalTransport:
    transport = create_transport(TransportConfig(backend="local"))
    assert isinstance(transport, LocalTransport)
    transport.register(pool.data_ptr(), pool_bytes(pool))
    return transport


def _remote(transport: LocalTransport, pool: torch.Tensor, page_ids: list[int]) -> RemotePages:
    return RemotePages(session_id=transport.session_id, base_addr=pool.data_ptr(),
                       page_bytes=page_bytes(pool), page_ids=tuple(page_ids))


def test_session_ids_are_unique_and_local() -> None:
    with LocalTransport() as a, LocalTransport() as b:
        assert a.session_id != b.session_id
        assert a.session_id.startswith("local:")


def test_a_write_is_done_when_write_pages_returns() -> None:
    src_pool, dst_pool = make_pool(random=True), make_pool(random=False)
    with _registered(src_pool) as sender, _registered(dst_pool) as receiver:
        write = sender.write_pages(src_pool.data_ptr(), [3, 4], _remote(receiver, dst_pool, [0, 1]))
        assert write.done()
        assert write.result().num_writes == 1
    assert torch.equal(dst_pool[:2], src_pool[3:5])


def test_errors_name_what_is_wrong() -> None:
    src_pool, dst_pool = make_pool(random=True), make_pool(random=False)
    with _registered(src_pool) as sender, _registered(dst_pool) as receiver:
        nobody = RemotePages(session_id="local:nobody", base_addr=4096, page_bytes=page_bytes(src_pool),
                             page_ids=(0,))
        with pytest.raises(KVTransferError, match="no local KV transport"):
            sender.write_pages(src_pool.data_ptr(), [0], nobody).result()
        outside = _remote(receiver, dst_pool, [3, len(dst_pool)])
        with pytest.raises(KVTransferError, match="destination on local:"):
            sender.write_pages(src_pool.data_ptr(), [0, 1], outside).result()
    assert torch.count_nonzero(dst_pool) == 0


def test_gpu_memory_is_refused_with_the_reason() -> None:
    """memmove reaches host memory only: a pool on a GPU is refused before it is recorded."""
    pool = make_pool(random=False)
    with LocalTransport() as transport:
        transport.check_device("cpu")
        with pytest.raises(KVTransferError, match="moves host memory only, not cuda:0 memory"):
            transport.register(pool.data_ptr(), pool_bytes(pool), "cuda:0")
        assert transport._regions.snapshot() == ()
        transport.register(pool.data_ptr(), pool_bytes(pool), "cpu")
        assert [r.device for r in transport._regions.snapshot()] == ["cpu"]
