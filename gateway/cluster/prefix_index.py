"""An approximate index of what one worker's prefix cache holds, kept by the gateway (one per prefill
and per decode worker: `gateway/cluster/routing.py`).

The worker's cache (engine/prefix_cache.py) holds full pages of tokens, keyed by the page and
everything before it. The gateway cannot see it, so it remembers the page-aligned prefixes it routed
to the worker: `page_hashes` names each full page of a prompt by a hash chained over every page up to
it, so one hash stands for a whole prefix and two prompts share a hash exactly when they share that
many pages. The index is bounded (at most the worker's pool, in pages) and evicts the least recently
routed prefix first, deepest pages first, as the worker's own cache evicts leaves first. A prompt run
under a LoRA adapter chains its hashes from the adapter's name, as the worker keys its cache by
adapter: the same tokens under another adapter (or none) share no page. Each answer that reports
cache hits (a prefill's, a decode worker's Reserve or local prefill) corrects it (`correct`): the
worker's `cached_tokens` says how much of the prompt it really held, so an index that promised more
shrinks towards the worker's real cache, and one that promised less (another gateway sent that
prefix there) grows. No I/O; event loop only.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence


def page_hashes(token_ids: Sequence[int], page_size: int, lora_name: str = "") -> tuple[int, ...]:
    """One hash per full page of `token_ids`: hash i stands for the prefix of pages 0..i, run under
    the adapter `lora_name` ("" the base model)."""
    hashes: list[int] = []
    previous = hash(("lora", lora_name)) if lora_name else 0
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        previous = hash((previous, tuple(token_ids[start : start + page_size])))
        hashes.append(previous)
    return tuple(hashes)


class PromptPages:
    """A prompt's token ids, the adapter it runs under (`lora_name`, "" the base model) and its
    `page_hashes`, computed once per page size however often the prompt is routed (a request is routed
    afresh on each admission retry and each failover)."""

    __slots__ = ("token_ids", "lora_name", "_hashes")

    def __init__(self, token_ids: Sequence[int], lora_name: str = "") -> None:
        self.token_ids = token_ids
        self.lora_name = lora_name
        self._hashes: dict[int, tuple[int, ...]] = {}  # page size -> hashes

    def __len__(self) -> int:
        return len(self.token_ids)

    def hashes(self, page_size: int) -> tuple[int, ...]:
        found = self._hashes.get(page_size)
        if found is None:
            found = self._hashes[page_size] = page_hashes(self.token_ids, page_size, self.lora_name)
        return found


class PrefixIndex:
    """The prefixes (as `page_hashes`) routed to one worker, at most `capacity` pages, least recently
    routed evicted first. `max_capacity` is the worker's whole pool; `correct` moves `capacity`
    between a quarter of it and all of it."""

    def __init__(self, max_capacity: int) -> None:
        if max_capacity < 1:
            raise ValueError(f"max_capacity must be >= 1, got {max_capacity}")
        self.max_capacity = max_capacity
        self.capacity = max_capacity
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading pages of the prompt with these `hashes` the worker likely holds."""
        num_pages = 0
        for page_hash in hashes:
            if page_hash not in self._lru:
                break
            num_pages += 1
        return num_pages

    def insert(self, hashes: Sequence[int]) -> None:
        """The prompt's pages are (or will be, once its prefill ran) in the worker's cache. Touched
        deepest first, so its first pages are the most recent and its last ones are evicted first."""
        for page_hash in reversed(hashes):
            self._lru[page_hash] = None
            self._lru.move_to_end(page_hash)
        self._evict()

    def correct(self, hashes: Sequence[int], estimated_pages: int, real_pages: int) -> None:
        """The worker reports it held `real_pages` of the prompt where the index said `estimated_pages`.
        Fewer: it evicted pages the index still had, so the index's capacity shrinks by as many; more:
        it held pages routed there by someone else, so the capacity grows. Its pages are then inserted."""
        missing = estimated_pages - real_pages
        floor = max(1, self.max_capacity // 4)
        self.capacity = max(floor, min(self.max_capacity, self.capacity - missing))
        self.insert(hashes)

    def clear(self) -> None:
        """The worker restarted or flushed its cache: it holds nothing."""
        self._lru.clear()
        self.capacity = self.max_capacity

    def _evict(self) -> None:
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)
