"""Tests for engine.page_allocator: every page id is free or held by exactly one owner."""

from __future__ import annotations

import pytest

from engine.errors import CapacityError
from engine.page_allocator import PageAllocator, pages_needed


@pytest.mark.parametrize(("num_tokens", "page_size", "expected"),
                         [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3),
                          (1, 1, 1), (17, 16, 2)])
def test_pages_needed_rounds_up(num_tokens: int, page_size: int, expected: int) -> None:
    assert pages_needed(num_tokens, page_size) == expected


@pytest.mark.parametrize("num_pages", [0, -3])
def test_rejects_non_positive_pool(num_pages: int) -> None:
    with pytest.raises(ValueError):
        PageAllocator(num_pages)


def test_allocate_hands_out_distinct_ids_in_range() -> None:
    allocator = PageAllocator(8)
    first = allocator.allocate(3)
    second = allocator.allocate(5)
    assert len(first) == 3 and len(second) == 5
    assert sorted(first + second) == list(range(8))
    assert allocator.num_free == 0 and allocator.num_used == 8
    assert allocator.can_allocate(0) and not allocator.can_allocate(1)


def test_allocate_too_many_raises_and_takes_nothing() -> None:
    allocator = PageAllocator(4)
    allocator.allocate(3)
    assert not allocator.can_allocate(2)
    with pytest.raises(CapacityError):
        allocator.allocate(2)
    assert allocator.num_free == 1
    assert allocator.allocate(1)  # the one free page is still there


def test_freed_pages_can_be_allocated_again() -> None:
    allocator = PageAllocator(4)
    ids = allocator.allocate(4)
    allocator.free(ids[1:3])
    assert allocator.num_free == 2 and allocator.num_used == 2
    again = allocator.allocate(2)
    assert sorted(again) == sorted(ids[1:3])
    allocator.free(ids[:1] + again + ids[3:])
    assert allocator.num_free == 4


def test_double_free_raises() -> None:
    allocator = PageAllocator(4)
    ids = allocator.allocate(2)
    allocator.free(ids[:1])
    with pytest.raises(ValueError):
        allocator.free(ids[:1])
    assert allocator.num_free == 3


def test_duplicate_ids_in_one_free_call_raise_and_change_nothing() -> None:
    allocator = PageAllocator(4)
    page_id = allocator.allocate(1)[0]
    with pytest.raises(ValueError):
        allocator.free([page_id, page_id])
    assert allocator.num_free == 3  # the page is neither freed nor on the free list twice
    allocator.free([page_id])
    assert sorted(allocator.allocate(4)) == [0, 1, 2, 3]


@pytest.mark.parametrize("bad_id", [-1, 4, 100])
def test_free_out_of_range_raises(bad_id: int) -> None:
    allocator = PageAllocator(4)
    allocator.allocate(4)
    with pytest.raises(ValueError):
        allocator.free([bad_id])
    assert allocator.num_free == 0


def test_free_with_one_bad_id_frees_none() -> None:
    allocator = PageAllocator(4)
    ids = allocator.allocate(2)
    free_id = next(i for i in range(4) if i not in ids)
    with pytest.raises(ValueError):
        allocator.free([ids[0], free_id])
    assert allocator.num_free == 2
    allocator.free([ids[0]])  # still allocated, so this succeeds
    assert allocator.num_free == 3
