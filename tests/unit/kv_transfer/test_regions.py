"""Registered-memory bookkeeping (kv_transfer/regions.py)."""

import pytest

from kv_transfer import KVTransferError
from kv_transfer.regions import MemoryRegion, MemoryRegions


def test_covers_only_ranges_inside_one_region() -> None:
    regions = MemoryRegions()
    regions.add(1000, 100)
    regions.add(2000, 100)
    assert regions.covers(1000, 100)
    assert regions.covers(1050, 50)
    assert not regions.covers(1050, 51)
    assert not regions.covers(999, 1)
    assert not regions.covers(1090, 920)  # spans the gap between two regions


def test_add_rejects_overlap_and_empty_ranges() -> None:
    regions = MemoryRegions()
    regions.add(1000, 100)
    with pytest.raises(KVTransferError, match="overlaps"):
        regions.add(1099, 10)
    with pytest.raises(KVTransferError, match="positive"):
        regions.add(5000, 0)
    with pytest.raises(KVTransferError, match="positive"):
        regions.add(0, 10)
    regions.add(1100, 10)  # adjacent is fine
    assert regions.snapshot() == (MemoryRegion(1000, 100), MemoryRegion(1100, 10))


def test_require_names_the_offending_range() -> None:
    regions = MemoryRegions()
    regions.add(0x1000, 0x100)
    regions.require((0x1000, 0x1080), (0x80, 0x80), "source")
    with pytest.raises(KVTransferError, match=r"source range \[0x10c0, 0x1140\)"):
        regions.require((0x1000, 0x10C0), (0x80, 0x80), "source")


def test_remove_and_clear() -> None:
    regions = MemoryRegions()
    first = regions.add(1000, 10)
    regions.add(2000, 10)
    regions.remove(first)
    assert not regions.covers(1000, 10)
    assert regions.clear() == (MemoryRegion(2000, 10),)
    assert not regions.covers(2000, 10)


def test_a_region_records_whose_memory_it_is() -> None:
    regions = MemoryRegions()
    host = regions.add(0x1000, 0x100)
    gpu = regions.add(0x7F00_0000_0000, 0x1000, "cuda:1")
    assert (host.device, gpu.device) == ("cpu", "cuda:1")
    assert regions.snapshot() == (MemoryRegion(0x1000, 0x100, "cpu"), MemoryRegion(0x7F00_0000_0000, 0x1000, "cuda:1"))
    with pytest.raises(KVTransferError, match="overlaps"):   # one address space under CUDA's unified addressing
        regions.add(0x7F00_0000_0800, 0x1000, "cpu")
