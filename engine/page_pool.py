"""The one page interface the scheduler and the engine use: `PagePool`, with or without a prefix cache. No torch.

Every KV page id is, at any moment, exactly one of: free (in the `PageAllocator`), cached (owned
by the prefix cache, whether or not requests use it), or held privately by one request or
reservation. `PrefixCache` (engine/prefix_cache.py) is the real cache; `NoPrefixCache` is its null
object, so callers never ask whether there is a cache: matching finds nothing, inserting keeps
nothing, releasing frees.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

from engine.page_allocator import PageAllocator


class PagePool(ABC):
    """Pages for requests over `allocator`. Single-threaded, like the engine.

    A caller owns the pages `allocate` and `match` return until it hands them to `release`; it
    must never free them through the allocator itself, since a matched or inserted page belongs
    to the cache and only loses a reference.
    """

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.is_recording_events = False

    @property
    def num_pages(self) -> int:
        """Pages in the whole pool."""
        return self.allocator.num_pages

    @property
    @abstractmethod
    def num_cached_pages(self) -> int:
        """Pages the cache owns, used or not."""

    @property
    @abstractmethod
    def num_evictable_pages(self) -> int:
        """Cached pages no request uses: reclaimed by `allocate` when the allocator runs short."""

    @abstractmethod
    def match(self, token_ids: list[int], namespace: str = "") -> list[int]:
        """Pages holding the longest cached prefix of `token_ids` cached in `namespace` (a LoRA
        adapter's id; "" for the base model), each gaining a reference."""

    @abstractmethod
    def insert(self, token_ids: list[int], page_ids: list[int], num_matched_pages: int, namespace: str = "") -> None:
        """Offer the full pages of a just-computed prompt to the cache, in `namespace` (the first
        `num_matched_pages` came from `match`). The caller keeps using every page either way."""

    @abstractmethod
    def release(self, page_ids: list[int]) -> None:
        """A request stops using these pages: cached ones lose a reference, the others are freed."""

    @abstractmethod
    def allocate(self, num: int) -> list[int]:
        """`num` private pages; raises CapacityError, taking none, when even eviction could not make room."""

    @abstractmethod
    def flush(self) -> int:
        """Drop every cached page no request uses; returns how many were freed."""

    @abstractmethod
    def cached_page_refs(self) -> Mapping[int, int]:
        """Each cached page and how many requests use it (a copy; for checks and tests)."""

    def page_keys(self) -> list[int]:
        """The page key (tandem/page_keys.py) of every cached page: what KV events snapshot."""
        return []

    def take_events(self) -> tuple[list[int], list[int]]:
        """The page keys stored in and removed from the cache since the last call, while
        `is_recording_events` is set (a KV events publisher: server_runtime/engine_loop.py)."""
        return [], []

    def can_allocate(self, num: int) -> bool:
        return self.allocator.num_free + self.num_evictable_pages >= num

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests and debugging).
        Subclasses extend it with their own structure."""
        self.allocator.check_integrity()
        refs = self.cached_page_refs()
        assert all(self.allocator.is_allocated(page_id) for page_id in refs), "a cached page is also free"
        assert len(refs) == self.num_cached_pages, "cached page count"
        assert sum(1 for n in refs.values() if n == 0) == self.num_evictable_pages, "evictable page count"


class NoPrefixCache(PagePool):
    """The null cache: nothing is ever cached, so every page a request holds is private."""

    @property
    def num_cached_pages(self) -> int:
        return 0

    @property
    def num_evictable_pages(self) -> int:
        return 0

    def match(self, token_ids: list[int], namespace: str = "") -> list[int]:
        return []

    def insert(self, token_ids: list[int], page_ids: list[int], num_matched_pages: int, namespace: str = "") -> None:
        pass

    def release(self, page_ids: list[int]) -> None:
        self.allocator.free(page_ids)

    def allocate(self, num: int) -> list[int]:
        return self.allocator.allocate(num)

    def flush(self) -> int:
        return 0

    def cached_page_refs(self) -> Mapping[int, int]:
        return {}
