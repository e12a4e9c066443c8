"""Reservations of pages for KV written from elsewhere: TTL, touch, admission, and the write grace. Plain Python."""

from __future__ import annotations

from engine.page_allocator import PageAllocator
from engine.page_pool import NoPrefixCache
from engine.reservations import Reservation, Reservations


def _reservations() -> tuple[Reservations, PageAllocator]:
    allocator = PageAllocator(8)
    return Reservations(NoPrefixCache(allocator, 4)), allocator


def test_a_reservation_expires_after_its_ttl_unless_touched() -> None:
    reservations, allocator = _reservations()
    reservations.add("a", Reservation(allocator.allocate(2), prompt_len=5, expires_at=10.0, grace_s=0.0))
    reservations.add("b", Reservation(allocator.allocate(1), prompt_len=3, expires_at=10.0, grace_s=0.0))
    reservations.touch("b", expires_at=30.0)
    reservations.touch("b", expires_at=20.0)     # never shortened
    reservations.touch("unknown", expires_at=99.0)
    assert reservations.expire(now=9.0) == [] and len(reservations) == 2
    assert reservations.expire(now=10.0) == ["a"] and allocator.num_free == 7
    assert reservations.expire(now=29.0) == [] and "b" in reservations
    assert reservations.expire(now=30.0) == ["b"] and allocator.num_free == 8 and not reservations


def test_taking_a_reservation_hands_its_pages_over_without_freeing_them() -> None:
    reservations, allocator = _reservations()
    pages = allocator.allocate(3)
    reservations.add("a", Reservation(pages, prompt_len=9, expires_at=1.0, grace_s=5.0))
    assert reservations.get("a") is not None and reservations.take("a").page_ids == pages
    assert "a" not in reservations and reservations.expire(now=100.0) == [] and allocator.num_used == 3
    assert reservations.drop("a", now=100.0) is False


def test_dropped_pages_sit_out_the_grace_unless_the_write_is_settled() -> None:
    reservations, allocator = _reservations()
    reservations.add("a", Reservation(allocator.allocate(2), prompt_len=5, expires_at=50.0, grace_s=5.0))
    reservations.add("b", Reservation(allocator.allocate(2), prompt_len=5, expires_at=50.0, grace_s=5.0))
    assert reservations.drop("a", now=1.0) and reservations.num_quarantined_pages == 2
    assert reservations.drop("b", now=1.0, write_settled=True) and allocator.num_free == 6
    assert reservations.expire(now=5.9) == [] and allocator.num_free == 6
    reservations.expire(now=6.0)
    assert allocator.num_free == 8 and reservations.num_quarantined_pages == 0
