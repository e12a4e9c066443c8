"""The page interface with and without a prefix cache, driven by seeded random operations.

Each run plays what the scheduler and the engine do (prompts sharing system prompts and earlier
turns are matched, allocated, written, cached, grown while decoding, released; reservations come
and go; the cache is evicted and flushed) and checks after every operation that each page is
exactly one of free, cached or held by one request, that reference counts equal the requests
holding each cached page, and that a matched page holds the very prefix it was matched for.
Plain Python."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from engine.errors import CapacityError
from engine.page_allocator import PageAllocator, pages_needed
from engine.page_pool import NoPrefixCache, PagePool
from engine.prefix_cache import PrefixCache

NUM_OPS = 400


@dataclass
class _Holder:
    """A request (or a reservation) as the scheduler sees it: its tokens and its pages in order."""

    token_ids: list[int]
    page_ids: list[int] = field(default_factory=list)
    num_matched_pages: int = 0
    is_inserted: bool = False
    is_reservation: bool = False


class _Run:
    def __init__(self, pool: PagePool, seed: int) -> None:
        self.pool = pool
        self.rng = random.Random(seed)
        self.holders: list[_Holder] = []
        self.contents: dict[int, tuple[int, ...]] = {}   # page -> the prefix whose last page's KV it holds
        self.prompts: list[list[int]] = []
        self.system_prompts = [[self.rng.randrange(1000) for _ in range(self.rng.randint(8, 80))] for _ in range(3)]
        self.num_matched = 0

    def _prompt(self) -> list[int]:
        rng = self.rng
        if self.prompts and rng.random() < 0.4:   # the same conversation again, maybe one turn longer
            earlier = rng.choice(self.prompts)
            prompt = earlier + [rng.randrange(1000) for _ in range(rng.choice((0, rng.randint(1, 40))))]
        else:
            prompt = rng.choice(self.system_prompts) + [rng.randrange(1000) for _ in range(rng.randint(1, 60))]
        self.prompts.append(prompt)
        return prompt

    def _write(self, holder: _Holder, first_index: int) -> None:
        """'Compute' the KV of the holder's pages from `first_index` on: each page holds its prefix."""
        size = self.pool.page_size
        for index in range(first_index, len(holder.page_ids)):
            self.contents[holder.page_ids[index]] = tuple(holder.token_ids[:(index + 1) * size])

    def admit(self) -> None:
        """Match a new prompt's cached prefix and allocate the rest of its pages, as `Scheduler` does."""
        holder = _Holder(self._prompt())
        matched = self.pool.match(holder.token_ids)
        size = self.pool.page_size
        assert len(matched) * size <= len(holder.token_ids) - 1, "a match must leave a token to compute"
        for index, page_id in enumerate(matched):
            assert self.contents[page_id] == tuple(holder.token_ids[:(index + 1) * size]), "matched a wrong page"
        self.num_matched += len(matched)
        needed = pages_needed(len(holder.token_ids), size) - len(matched)
        if not self.pool.can_allocate(needed):
            with pytest.raises(CapacityError):   # taking nothing: the check after this operation sees it
                self.pool.allocate(needed)
            self.pool.release(matched)
            return
        holder.page_ids = matched + self.pool.allocate(needed)
        holder.num_matched_pages = len(matched)
        self._write(holder, len(matched))
        self.holders.append(holder)

    def finish_prefill(self) -> None:
        waiting = [h for h in self.holders if not h.is_inserted and not h.is_reservation]
        if waiting:
            holder = self.rng.choice(waiting)
            self.pool.insert(holder.token_ids, holder.page_ids, holder.num_matched_pages)
            holder.is_inserted = True

    def decode(self) -> None:
        """A running request writes tokens past its pages and takes one more."""
        running = [h for h in self.holders if h.is_inserted]
        if running and self.pool.can_allocate(1):
            holder = self.rng.choice(running)
            size = self.pool.page_size
            holder.token_ids += [self.rng.randrange(1000) for _ in range(len(holder.page_ids) * size
                                                                           - len(holder.token_ids) + 1)]
            holder.page_ids += self.pool.allocate(1)

    def reserve(self) -> None:
        num = self.rng.randint(1, 6)
        if self.pool.can_allocate(num):
            self.holders.append(_Holder([], self.pool.allocate(num), is_reservation=True))

    def release(self) -> None:
        if self.holders:
            holder = self.holders.pop(self.rng.randrange(len(self.holders)))
            self.pool.release(holder.page_ids)

    def evict(self) -> None:
        if isinstance(self.pool, PrefixCache):
            free = self.pool.allocator.num_free
            freed = self.pool.evict(self.rng.randint(1, 8))
            assert self.pool.allocator.num_free == free + freed

    def flush(self) -> None:
        evictable, free = self.pool.num_evictable_pages, self.pool.allocator.num_free
        assert self.pool.flush() == evictable and self.pool.allocator.num_free == free + evictable
        assert self.pool.num_evictable_pages == 0

    def check(self) -> None:
        """Every page free, cached or held by exactly one holder; references equal the holders."""
        pool, allocator = self.pool, self.pool.allocator
        pool.check_integrity()
        refs = pool.cached_page_refs()
        holders_of = Counter(page_id for h in self.holders for page_id in h.page_ids)
        private = {page_id for page_id in holders_of if page_id not in refs}
        for page_id, count in holders_of.items():
            assert allocator.is_allocated(page_id), f"held page {page_id} is also free"
            assert page_id in refs or count == 1, f"private page {page_id} held {count} times"
        for page_id, count in refs.items():
            assert count == holders_of.get(page_id, 0), f"cached page {page_id}: {count} refs"
        assert allocator.num_free + len(refs) + len(private) == allocator.num_pages, "a page is lost"
        assert pool.num_evictable_pages == sum(1 for count in refs.values() if count == 0)
        assert pool.can_allocate(allocator.num_free + pool.num_evictable_pages)
        assert not pool.can_allocate(allocator.num_free + pool.num_evictable_pages + 1)

    def check_each_cached_page_is_found_by_its_prefix(self) -> None:
        """Matching the prefix a cached page holds (plus a token to compute) ends at that very page.
        Run once at the end: the matches touch every page and would change the eviction order."""
        for page_id in self.pool.cached_page_refs():
            matched = self.pool.match(list(self.contents[page_id]) + [0])
            self.pool.release(matched)
            assert matched and matched[-1] == page_id, f"cached page {page_id} is not found by its prefix"


_OPERATIONS = {"admit": 5, "finish_prefill": 4, "decode": 3, "reserve": 1, "release": 4, "evict": 1, "flush": 0.2}


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("pool_type", [PrefixCache, NoPrefixCache])
def test_random_operations_keep_every_page_accounted_for(pool_type: type[PagePool], seed: int,
                                                          page_size: int) -> None:
    run = _Run(pool_type(PageAllocator(48 if page_size == 4 else 24), page_size), seed)
    names, weights = list(_OPERATIONS), list(_OPERATIONS.values())
    for _ in range(NUM_OPS):
        getattr(run, run.rng.choices(names, weights)[0])()
        run.check()
    run.check_each_cached_page_is_found_by_its_prefix()
    run.check()
    while run.holders:
        run.release()
        run.check()
    run.pool.flush()
    run.check()
    assert run.pool.allocator.num_free == run.pool.allocator.num_pages
    if pool_type is PrefixCache:   # the shared prefixes were found, so the checks above saw the cache at work
        assert run.num_matched > 0
    else:
        assert run.num_matched == 0 and run.pool.num_cached_pages == 0


def test_a_broken_reference_count_fails_the_check() -> None:
    cache = PrefixCache(PageAllocator(8), 4)
    tokens = list(range(9))
    pages = cache.allocate(3)
    cache.insert(tokens, pages, 0)
    cache.release(pages)
    cache.check_integrity()
    cache._nodes[pages[1]].ref_count = 1   # as if a release were lost: the count and the heap disagree
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_a_reused_leaf_is_evicted_after_one_left_untouched() -> None:
    cache = PrefixCache(PageAllocator(4), 4)
    a, b = list(range(100, 105)), list(range(200, 205))   # one cached page each, plus a partial page
    for tokens in (a, b):
        pages = cache.allocate(2)
        cache.insert(tokens, pages, 0)
        cache.release(pages)
    again = cache.match(a)                   # a's page was used last
    cache.release(again)
    assert cache.evict(1) == 1 and cache.match(a) == again and cache.num_cached_pages == 1
    cache.check_integrity()
