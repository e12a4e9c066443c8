"""The prefix cache's host-memory tier, and the chain of tiers a walk down the tree continues into.

`HostTier` keeps copies of full KV pages in host memory (pinned when the pool is on a GPU, so the copies
run at full speed both ways), by the same digests as the disk tier (`engine.prefix_cache.page_digest`),
at most `capacity_bytes`, least recently used dropped first. A page the pool evicts is then still a
copy away instead of a recompute: on a GPU the pool is small and host memory large; on a CPU it lets
the pool stay the size the decode batch needs while the cache keeps more.

`TierChain` puts tiers in order, fastest first (host, disk, then the cluster's store): a page joins every tier, a lookup
takes the first that holds it, and a page found only in a slower tier is copied into the faster ones
on its way back into the pool. `tier_chain` builds the chain an engine's config asks for.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

from engine.config import EngineConfig
from engine.kv_disk_tier import DiskTier, copy_payload, kv_identity, root_digest
from engine.kv_pool import KVPool
from engine.kv_store_tier import StoreAccess, StoreTier
from engine.prefix_cache import PageRead
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
        # Copies in memory are never damaged nor away, and are made at once: the stats' shape.
        self.num_dropped = self.num_failed = self.num_pending = 0
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


TierReads = list[tuple[bytes, "DiskTier | StoreTier", PageRead]]  # a fetch's reads: digest, where, what


class TierChain:
    """Tiers fastest first (a `HostTier`, a `DiskTier`, a `StoreTier`), seen by the prefix cache as one
    `PageTier` over KV computed with the weights named `weights_identity`.

    A walk down the prefix tree reads only what is at hand: the host tier, and the pages a fetch brought
    (`adopt`). The slow tiers are read by `fetch`, which runs off the engine thread while its request waits
    ("loading"), or on it where no thread is given; `adopt` then hands the pages it found to the next walk."""

    def __init__(
        self, host: HostTier | None, disk: DiskTier | None, store: StoreTier | None, weights_identity: str
    ) -> None:
        self.host, self.disk, self.store = host, disk, store
        self.tiers: list[HostTier | DiskTier | StoreTier] = [t for t in (host, disk, store) if t is not None]
        self._identity = kv_identity(weights_identity, self.tiers[0].pool.layout)
        self._fetched: dict[bytes, tuple[DiskTier | StoreTier, bytes]] = {}  # digest -> where from, its bytes

    def set_identity(self, weights_identity: str) -> None:
        """New weights: no page computed with the old ones is found again."""
        self._identity = kv_identity(weights_identity, self.tiers[0].pool.layout)
        self._fetched.clear()
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            self.disk.set_identity(weights_identity)

    def root(self, namespace: str) -> bytes:
        return root_digest(self._identity, namespace)

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(
            TierStats(
                name,
                tier.num_pages,
                tier.num_saved,
                tier.num_loaded,
                tier.num_dropped,
                tier.num_failed,
                tier.num_pending,
            )
            for name, tier in (("host", self.host), ("disk", self.disk), ("store", self.store))
            if tier is not None
        )

    @property
    def has_slow_tiers(self) -> bool:
        return self.disk is not None or self.store is not None

    def is_worth_fetching(self, digest: bytes) -> bool:
        """Whether a fetch starting at `digest` may find anything: the disk tier holds it, or a store may."""
        return self.store is not None or (self.disk is not None and self.disk.contains(digest))

    def fetch(self, digests: list[bytes]) -> TierReads:
        """Read `digests` in order from the disk tier, else the store, up to the first page neither has:
        every read, with its digest and tier. Touches no state here, so it may run off the engine thread;
        hand the result to `adopt` on it."""
        reads: TierReads = []
        for digest in digests:
            found = False
            for tier in (self.disk, self.store):
                if tier is not None:
                    read = tier.read(digest)
                    reads.append((digest, tier, read))
                    if found := read.payload is not None:
                        break
            if not found:
                break
        return reads

    def adopt(self, reads: TierReads) -> None:
        """On the engine thread: account for a `fetch` (a damaged page is dropped where it was found) and
        keep the pages it found for the walks until `forget_fetched`."""
        for digest, tier, read in reads:
            if (payload := tier.took(digest, read)) is not None:
                self._fetched[digest] = (tier, payload)

    def forget_fetched(self) -> None:
        self._fetched.clear()

    def contains(self, digest: bytes) -> bool:
        return digest in self._fetched or (self.host is not None and self.host.contains(digest))

    def save(self, digest: bytes, page_id: int) -> None:
        for tier in self.tiers:
            tier.save(digest, page_id)

    def load(self, digest: bytes, page_id: int) -> bool:
        if self.host is not None and self.host.load(digest, page_id):
            return True
        fetched = self._fetched.pop(digest, None)
        if fetched is None:
            return False
        tier, payload = fetched
        copy_payload(payload, tier.pool, page_id)
        tier.num_loaded += 1
        if self.host is not None:  # on its way back, the host tier keeps it too
            self.host.save(digest, page_id)
        if tier is self.store and self.disk is not None:
            self.disk.save(digest, page_id)
        return True


def tier_chain(
    config: EngineConfig,
    pool: KVPool,
    weights_identity: str,
    background: Callable[[Callable[[], None]], object] | None,
    kv_store: StoreAccess | None,
) -> TierChain | None:
    """The prefix cache's tiers beyond the pool, from `config` and `kv_store` (None: no tier at all)."""
    host = HostTier(int(config.kv_host_cache_gib * 2**30), pool) if config.kv_host_cache_gib else None
    disk = None
    if config.kv_disk_cache_dir is not None:
        capacity = int(config.kv_disk_cache_gib * 2**30)
        disk = DiskTier(config.kv_disk_cache_dir, capacity, pool, weights_identity, background)
    store = StoreTier(kv_store.store, pool, kv_store.secret) if kv_store is not None else None
    return TierChain(host, disk, store, weights_identity) if host or disk or store else None
