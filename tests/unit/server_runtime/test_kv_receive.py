"""The decode side's KV connector on its own: reservation deadlines, `keep`, and the write-grace quarantine
(the engine's use of it: tests/unit/engine/test_engine.py, test_decode_prefix_cache.py)."""

from __future__ import annotations

import pytest

from engine.request import Request, RequestStatus, SamplingParams
from server_runtime.kv_receive import KVReceiveConnector


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _reserved(request_id: str, page_ids: list[int]) -> Request:
    return Request(request_id, [], SamplingParams(), page_ids=page_ids, status=RequestStatus.RECEIVING)


def test_a_reservation_expires_after_its_ttl_and_is_reported_once() -> None:
    clock = Clock()
    receiver = KVReceiveConnector(ttl_s=10.0, grace_s=0.0, clock=clock)
    receiver.on_reserved(_reserved("a", [1]))
    clock.now = 5.0
    receiver.on_reserved(_reserved("b", [2]))
    assert receiver.poll().expired == [] and receiver.num_reservations == 2
    clock.now = 10.0
    assert receiver.poll().expired == ["a"]
    assert receiver.poll().expired == [] and receiver.num_reservations == 1
    clock.now = 15.0
    assert receiver.poll().expired == ["b"] and receiver.num_reservations == 0


def test_keep_extends_a_reservation_and_admission_ends_its_deadline() -> None:
    clock = Clock()
    receiver = KVReceiveConnector(ttl_s=10.0, grace_s=0.0, clock=clock)
    kept, admitted = _reserved("kept", [1]), _reserved("admitted", [2])
    receiver.on_reserved(kept)
    receiver.on_reserved(admitted)
    clock.now = 8.0
    receiver.keep("kept")
    receiver.keep("unknown")  # ignored
    receiver.on_received(admitted)
    clock.now = 12.0
    assert receiver.poll().expired == []
    clock.now = 18.0
    assert receiver.poll().expired == ["kept"]


def test_dropped_pages_sit_out_the_grace_unless_the_write_has_settled() -> None:
    clock = Clock()
    receiver = KVReceiveConnector(ttl_s=10.0, grace_s=3.0, clock=clock)
    for rid in ("first", "second", "settled"):
        receiver.on_reserved(_reserved(rid, []))
    assert receiver.on_dropped(_reserved("first", [4, 5, 6]), [5, 6], write_settled=False)
    clock.now = 1.0
    assert receiver.on_dropped(_reserved("second", [7]), [7], write_settled=False)
    assert not receiver.on_dropped(_reserved("settled", [8]), [8], write_settled=True)  # the engine frees it
    assert receiver.num_quarantined_pages == 3 and receiver.num_reservations == 0
    clock.now = 2.9
    assert receiver.poll().released == []
    clock.now = 3.0
    assert receiver.poll().released == [5, 6] and receiver.num_quarantined_pages == 1
    clock.now = 10.0
    polled = receiver.poll()
    assert polled.released == [7] and polled.expired == [] and receiver.poll().released == []


def test_no_grace_frees_at_once_and_bad_settings_are_refused() -> None:
    receiver = KVReceiveConnector(ttl_s=1.0, grace_s=0.0)
    assert not receiver.on_dropped(_reserved("r", [1]), [1], write_settled=False)
    for ttl_s, grace_s in ((0.0, 1.0), (1.0, -1.0)):
        with pytest.raises(ValueError):
            KVReceiveConnector(ttl_s, grace_s)

