"""Bookkeeping of the memory ranges a transport has registered, so writes can be checked against
them before any byte moves."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kv_transfer.base import KVTransferError


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """The byte range `[base_addr, base_addr + num_bytes)` of this process, in `device`'s memory
    ("cpu", or "cuda:<n>": the addresses are then device pointers)."""

    base_addr: int
    num_bytes: int
    device: str = "cpu"

    @property
    def end_addr(self) -> int:
        return self.base_addr + self.num_bytes

    def covers(self, addr: int, num_bytes: int) -> bool:
        """Whether `[addr, addr + num_bytes)` lies entirely inside this region."""
        return self.base_addr <= addr and addr + num_bytes <= self.end_addr


class MemoryRegions:
    """A thread-safe set of non-overlapping registered regions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: list[MemoryRegion] = []

    def add(self, base_addr: int, num_bytes: int, device: str = "cpu") -> MemoryRegion:
        """Record a region of `device`'s memory; raises `KVTransferError` if it is empty, starts at a
        non-positive address, or overlaps a region already recorded (host and device addresses share
        one space under CUDA's unified addressing, so regions of any devices are compared)."""
        if base_addr <= 0 or num_bytes <= 0:
            raise KVTransferError(f"cannot register base_addr={base_addr} num_bytes={num_bytes}: both must be positive")
        region = MemoryRegion(base_addr, num_bytes, device)
        with self._lock:
            for other in self._regions:
                if region.base_addr < other.end_addr and other.base_addr < region.end_addr:
                    raise KVTransferError(f"{region} overlaps registered {other}")
            self._regions.append(region)
        return region

    def remove(self, region: MemoryRegion) -> None:
        """Forget `region` if it is recorded."""
        with self._lock:
            if region in self._regions:
                self._regions.remove(region)

    def covers(self, addr: int, num_bytes: int) -> bool:
        """Whether `[addr, addr + num_bytes)` lies inside one registered region."""
        with self._lock:
            return any(region.covers(addr, num_bytes) for region in self._regions)

    def require(self, addrs: tuple[int, ...], lengths: tuple[int, ...], what: str) -> None:
        """Raise `KVTransferError` naming `what` unless every `[addrs[k], addrs[k] + lengths[k])`
        lies inside one registered region."""
        for addr, num_bytes in zip(addrs, lengths):
            if not self.covers(addr, num_bytes):
                raise KVTransferError(
                    f"{what} range [{addr:#x}, {addr + num_bytes:#x}) is not inside registered memory"
                )

    def snapshot(self) -> tuple[MemoryRegion, ...]:
        """The registered regions, in registration order."""
        with self._lock:
            return tuple(self._regions)

    def clear(self) -> tuple[MemoryRegion, ...]:
        """Forget every region; returns what was registered."""
        with self._lock:
            regions, self._regions = tuple(self._regions), []
        return regions
