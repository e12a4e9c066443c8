"""server_runtime/kv_send.py: the prefill side's KV connector, over the in-process transport and over a
transport whose writes never end (as Mooncake's to a stopped peer)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest
import torch

from engine.request import Request, SamplingParams
from kv_transfer import KVTransferError, KVTransferTimeout, RemotePages, TransportConfig, create_transport
from server_runtime.kv_send import KVSend, KVSendConnector, await_write

FAR = int((time.time() + 3600) * 1000)


def _computed(request_id: str, page_ids: list[int], send: KVSend) -> Request:
    """A prefill-only request as the engine hands it over: its prompt's KV in `page_ids`."""
    return Request(request_id, [1, 2, 3], SamplingParams(), is_prefill_only=True, page_ids=page_ids, kv_params=send)


def test_a_send_writes_the_pages_after_the_skipped_ones_and_is_polled_once() -> None:
    src, dst = torch.randn(4, 8), torch.zeros(4, 8)
    woken: list[bool] = []
    with create_transport(TransportConfig(backend="local")) as sender, \
            create_transport(TransportConfig(backend="local")) as receiver:
        for transport, pool in ((sender, src), (receiver, dst)):
            transport.register(pool.data_ptr(), pool.numel() * pool.element_size())
        connector = KVSendConnector(sender, src.data_ptr(), lambda: woken.append(True))
        send = KVSend(RemotePages(receiver.session_id, dst.data_ptr(), 8 * 4, (2, 3)), 1, FAR, timeout_s=5)
        assert not connector.on_finished(_computed("none", [0], None))  # type: ignore[arg-type]
        assert connector.on_finished(_computed("r", [0, 1, 3], send))  # page 0 is already on the decode side
        assert not send.written.done() and connector.poll().sent == []  # nothing starts before start_saves
        connector.start_saves()
        stats = asyncio.run(await_write(send))
        assert stats.num_bytes == 64 and torch.equal(dst[2], src[1]) and torch.equal(dst[3], src[3])
        assert woken == [True] and connector.poll().sent == ["r"] and connector.poll().sent == []
        with pytest.raises(KVTransferError, match="timeout_s"):   # refused before anything moves
            KVSend(send.dst, 0, FAR, timeout_s=0)


class _StalledTransport:
    """A transport whose writes never end."""

    def __init__(self) -> None:
        self.write: concurrent.futures.Future = concurrent.futures.Future()

    def write_pages(self, src_base_addr, src_page_ids, dst) -> concurrent.futures.Future:
        self.write.set_running_or_notify_cancel()
        return self.write


def test_a_send_past_its_deadline_times_out_its_waiter_and_gives_its_pages_back() -> None:
    transport = _StalledTransport()
    connector = KVSendConnector(transport, 4096)  # type: ignore[arg-type]
    send = KVSend(RemotePages("peer:1", 4096, 1024, (0, 1)), 0, FAR, timeout_s=0.05)
    assert connector.on_finished(_computed("r", [5, 6], send))
    started = time.monotonic()
    connector.start_saves()
    with pytest.raises(KVTransferTimeout, match="write of 2048 bytes to peer:1 did not complete within 0.05 s"):
        asyncio.run(await_write(send))
    assert time.monotonic() - started < 1.0
    assert transport.write.running() and not send.written.done()  # the write was not cancelled under the backend
    assert connector.poll().sent == ["r"] and connector.num_running == 0  # its deadline passed: the pages may go


def test_a_send_whose_grant_expired_or_whose_pages_do_not_match_writes_nothing() -> None:
    transport = _StalledTransport()
    connector = KVSendConnector(transport, 4096)  # type: ignore[arg-type]
    late = KVSend(RemotePages("peer:1", 4096, 1024, (0,)), 0, int(time.time() * 1000) - 1, timeout_s=5)
    short = KVSend(RemotePages("peer:1", 4096, 1024, (0, 1, 2)), 0, FAR, timeout_s=5)
    assert connector.on_finished(_computed("late", [1], late))
    assert connector.on_finished(_computed("short", [1, 2], short))
    connector.start_saves()
    with pytest.raises(KVTransferError, match="expired before the prompt's KV was ready"):
        late.written.result(timeout=0)
    with pytest.raises(KVTransferError, match="2 pages to send, the target 3"):
        short.written.result(timeout=0)
    assert not transport.write.running() and sorted(connector.poll().sent) == ["late", "short"]
