"""The prefix cache's host-memory tier, and the chain of tiers a walk down the tree continues into.

`HostTier` keeps copies of full KV pages in host memory (pinned when the pool is on a GPU, so the copies
run at full speed both ways), by the same digests as the disk tier (`engine.prefix_cache.page_digest`),
at most `capacity_bytes`, least recently used dropped first. A page the pool evicts is then still a
copy away instead of a recompute: on a GPU the pool is small and host memory large; on a CPU it lets
the pool stay the size the decode batch needs while the cache keeps more.

`TierChain` puts tiers in order, fastest first (host, disk, then the cluster's store): a page joins every tier, a lookup
takes the first that holds it, and a page found only in a slower tier is copied into the faster ones
on its way back into the pool.
"""

from __future__ import annotations

import collections

import torch

from engine.kv_disk_tier import DiskTier, kv_identity, root_digest
from engine.kv_pool import KVPool
from engine.kv_store_tier import StoreTier
from engine.stats import TierStats


class HostTier:
    """Copies of `pool`'s pages in host memory, at most `capacity_bytes`. Engine thread only.
    `num_saved` and `num_loaded` count pages copied out and back since start."""

    def __init__(self, capacity_bytes: int, pool: KVPool) -> None:
        page_bytes = pool.layout.page_bytes
        if capacity_bytes < page_bytes:
            raise ValueError(f"the host tier's capacity ({capacity_bytes} bytes) is less than one KV page")
        self.pool = pool
        self.capacity_pages = capacity_bytes // page_bytes
        self.num_saved = self.num_loaded = 0
        self.num_dropped = self.num_failed = 0  # copies in memory are never damaged nor away: the stats' shape
        self._pages: collections.OrderedDict[bytes, torch.Tensor] = collections.OrderedDict()  # LRU first
        self._pin = pool.device.type == "cuda"

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    def contains(self, digest: bytes) -> bool:
        return digest in self._pages

    def save(self, digest: bytes, page_id: int) -> None:
        if digest in self._pages:
            self._pages.move_to_end(digest)
            return
        if len(self._pages) >= self.capacity_pages:
            _, reused = self._pages.popitem(last=False)  # the oldest copy's buffer takes the new page
        else:
            reused = torch.empty_like(self.pool.tensor[page_id], device="cpu", pin_memory=self._pin)
        reused.copy_(self.pool.tensor[page_id], non_blocking=self._pin)
        self._pages[digest] = reused
        self.num_saved += 1

    def load(self, digest: bytes, page_id: int) -> bool:
        copy = self._pages.get(digest)
        if copy is None:
            return False
        self.pool.tensor[page_id].copy_(copy, non_blocking=self._pin)
        self._pages.move_to_end(digest)
        self.num_loaded += 1
        return True

    def clear(self) -> None:
        """Forget every copy (new weights)."""
        self._pages.clear()


class TierChain:
    """Tiers fastest first (a `HostTier`, a `DiskTier`, a `StoreTier`), seen by the prefix cache as one
    `PageTier` over KV computed with the weights named `weights_identity`."""

    def __init__(
        self, host: HostTier | None, disk: DiskTier | None, store: StoreTier | None, weights_identity: str
    ) -> None:
        self.host, self.disk, self.store = host, disk, store
        self.tiers: list[HostTier | DiskTier | StoreTier] = [t for t in (host, disk, store) if t is not None]
        self._identity = kv_identity(weights_identity, self.tiers[0].pool.layout)

    def set_identity(self, weights_identity: str) -> None:
        """New weights: no page computed with the old ones is found again."""
        self._identity = kv_identity(weights_identity, self.tiers[0].pool.layout)
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            self.disk.set_identity(weights_identity)

    def root(self, namespace: str) -> bytes:
        return root_digest(self._identity, namespace)

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(
            TierStats(name, tier.num_pages, tier.num_saved, tier.num_loaded, tier.num_dropped, tier.num_failed)
            for name, tier in (("host", self.host), ("disk", self.disk), ("store", self.store))
            if tier is not None
        )

    def contains(self, digest: bytes) -> bool:
        return any(tier.contains(digest) for tier in self.tiers)

    def save(self, digest: bytes, page_id: int) -> None:
        for tier in self.tiers:
            tier.save(digest, page_id)

    def load(self, digest: bytes, page_id: int) -> bool:
        for index, tier in enumerate(self.tiers):
            if tier.contains(digest) and tier.load(digest, page_id):
                for faster in self.tiers[:index]:  # on its way back, the faster tiers keep it too
                    faster.save(digest, page_id)
                return True
        return False
