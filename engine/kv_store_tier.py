"""The prefix cache's cluster-wide tier: full KV pages in a store every worker reaches (Mooncake Store,
`kv_transfer/mooncake_store.py`), so a prefix one worker computed is read by any other, and by itself
after a restart.

Pages go by the same digests as in the host and disk tiers (`engine.prefix_cache.page_digest`, chained
from the weights and the KV layout), so a name means the same KV in every process. The store checks no
credentials, so each page carries a tag: a keyed BLAKE2b of its name and bytes, keyed by a secret the
workers share and the store never holds (the worker derives it from its KV grant secret). A page whose
tag does not match (forged, damaged, or put by a worker with another secret) is dropped and counted,
never copied into the pool.

The store is best effort: a page it lacks, or a store that does not answer, is a miss, and the tokens
are computed again. `PageStore` bounds how long a lookup may take (`kv_transfer.mooncake_store.StoreClient`:
a quarter second, then the store counts as away for a while); puts run in the background.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.kv_disk_tier import load_read
from engine.kv_pool import KVPool
from engine.prefix_cache import PageRead

logger = logging.getLogger(__name__)

TAG_BYTES = 32
_KEY_PREFIX = "tandem-kv/"


class PageStore(Protocol):
    """Objects by key in a store outside this process (`kv_transfer.mooncake_store.StoreClient`). `get`
    returns within a bounded time (None: no such object, or no answer); `put` does not wait."""

    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, value: bytes) -> None: ...

    @property
    def num_failures(self) -> int:
        """Lookups that failed or got no answer in time, since start."""
        ...

    @property
    def num_pending_puts(self) -> int:
        """Puts queued that have not reached the store yet."""
        ...


@dataclass(frozen=True, slots=True)
class StoreAccess:
    """What a worker hands its engine for the store tier: the store, and the secret its pages are signed with."""

    store: PageStore
    secret: bytes = field(repr=False)


def page_tag(secret: bytes, digest: bytes, payload: bytes) -> bytes:
    """The tag a page named `digest` holding `payload` carries in the store."""
    return hashlib.blake2b(digest + payload, key=secret, digest_size=TAG_BYTES).digest()


class StoreTier:
    """`pool`'s pages in `store`, signed with `secret` (at most 64 bytes: BLAKE2b's key). Engine thread
    only. The store's size is the store's business, so `num_pages` counts the pages this worker put;
    `num_saved`, `num_loaded` and `num_dropped` are kept since start."""

    def __init__(self, store: PageStore, pool: KVPool, secret: bytes) -> None:
        if not 16 <= len(secret) <= 64:
            raise ValueError(f"the KV store's page key must be 16 to 64 bytes, got {len(secret)}")
        self.store, self.pool, self._secret = store, pool, secret
        self.num_saved = self.num_loaded = self.num_dropped = 0
        self._fetched: tuple[bytes, bytes | None] = (b"", None)  # the last page `contains` fetched, for `load`

    @property
    def num_pages(self) -> int:
        return self.num_saved

    @property
    def num_failed(self) -> int:
        return self.store.num_failures

    @property
    def num_pending(self) -> int:
        return self.store.num_pending_puts

    @staticmethod
    def key(digest: bytes) -> str:
        return _KEY_PREFIX + digest.hex()

    def contains(self, digest: bytes) -> bool:
        """Whether the store holds `digest`: the page is fetched (one round trip, as a bare lookup would
        take) and kept for the `load` that follows."""
        value = self.store.get(self.key(digest))
        self._fetched = (digest, value)
        return value is not None

    def save(self, digest: bytes, page_id: int) -> None:
        """Put page `page_id` (its KV complete) as `digest`; copied now, put in the background."""
        payload = self.pool.tensor[page_id].contiguous().view(torch.uint8).cpu().numpy().tobytes()
        self.store.put(self.key(digest), page_tag(self._secret, digest, payload) + payload)
        self.num_saved += 1

    def load(self, digest: bytes, page_id: int) -> bool:
        """Copy the page named `digest` into pool page `page_id`; False when the store lacks it, does
        not answer, or holds something that is not that page signed with this worker's secret."""
        fetched_digest, value = self._fetched
        self._fetched = (b"", None)
        if fetched_digest != digest:
            value = self.store.get(self.key(digest))
        return load_read(self, digest, self._checked(digest, value), page_id)

    def read(self, digest: bytes) -> PageRead:
        """The page named `digest`, fetched and its tag checked. Touches no state of the tier, so it may run
        off the engine thread (the store client is thread-safe); `took` then accounts for it."""
        return self._checked(digest, self.store.get(self.key(digest)))

    def _checked(self, digest: bytes, value: bytes | None) -> PageRead:
        if value is None:
            return PageRead(None)
        tag, payload = value[:TAG_BYTES], value[TAG_BYTES:]
        if len(payload) != self.pool.layout.page_bytes or page_tag(self._secret, digest, payload) != tag:
            return PageRead(None, "its tag does not match")
        return PageRead(payload)

    def took(self, digest: bytes, read: PageRead) -> bytes | None:
        """On the engine thread, after `read`: the page's bytes, or None (a forged or damaged page is counted).
        Does not count a load: the caller does, once the bytes are in the pool."""
        if read.problem:
            logger.warning("KV store: dropped page %s (%s); its tokens are computed again", digest.hex(), read.problem)
            self.num_dropped += 1
        return read.payload
