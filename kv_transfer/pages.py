"""Pure page arithmetic shared by every transport: coalescing page pairs into contiguous runs and
turning runs into byte-level writes. No I/O, no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv_transfer.base import KVTransferError, RemotePages


@dataclass(frozen=True, slots=True)
class PageRun:
    """`num_pages` consecutive source pages starting at `src_page_id`, copied to as many
    consecutive destination pages starting at `dst_page_id`."""

    src_page_id: int
    dst_page_id: int
    num_pages: int


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Byte-level writes for one `write_pages` call: write k copies `lengths[k]` bytes from local
    address `src_addrs[k]` to peer address `dst_addrs[k]`. Destination ranges never overlap."""

    src_addrs: tuple[int, ...]
    dst_addrs: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def num_writes(self) -> int:
        return len(self.lengths)

    @property
    def num_bytes(self) -> int:
        return sum(self.lengths)


def coalesce_page_runs(src_page_ids: Sequence[int], dst_page_ids: Sequence[int]) -> tuple[PageRun, ...]:
    """Group the pairs `(src_page_ids[k], dst_page_ids[k])` into maximal runs in which both ids
    grow by one per page.

    Pairs are sorted by source id first, so the order of the input does not limit coalescing; the
    set of page copies described is exactly the input's. Raises `KVTransferError` if the lists
    differ in length, an id is negative, or a destination id repeats (two sources for one page).
    """
    if len(src_page_ids) != len(dst_page_ids):
        raise KVTransferError(f"got {len(src_page_ids)} source pages but {len(dst_page_ids)} destination pages")
    pairs = sorted(zip((int(p) for p in src_page_ids), (int(p) for p in dst_page_ids)))
    if any(src < 0 or dst < 0 for src, dst in pairs):
        raise KVTransferError("page ids must be non-negative")
    if len({dst for _, dst in pairs}) != len(pairs):
        raise KVTransferError("destination page ids must be distinct")
    runs: list[PageRun] = []
    for src, dst in pairs:
        last = runs[-1] if runs else None
        if last is not None and src == last.src_page_id + last.num_pages and dst == last.dst_page_id + last.num_pages:
            runs[-1] = PageRun(last.src_page_id, last.dst_page_id, last.num_pages + 1)
        else:
            runs.append(PageRun(src, dst, 1))
    return tuple(runs)


def plan_page_writes(src_base_addr: int, src_page_ids: Sequence[int], dst: RemotePages) -> WritePlan:
    """Byte-level writes copying local pages `src_page_ids` (pool at `src_base_addr`) to
    `dst.page_ids`, one write per coalesced run; both pools use `dst.page_bytes` per page.
    Raises `KVTransferError` for a non-positive `src_base_addr` or invalid page ids."""
    if src_base_addr <= 0:
        raise KVTransferError(f"src_base_addr must be positive, got {src_base_addr}")
    runs = coalesce_page_runs(src_page_ids, dst.page_ids)
    page_bytes = dst.page_bytes
    return WritePlan(
        src_addrs=tuple(src_base_addr + r.src_page_id * page_bytes for r in runs),
        dst_addrs=tuple(dst.base_addr + r.dst_page_id * page_bytes for r in runs),
        lengths=tuple(r.num_pages * page_bytes for r in runs),
    )
