"""The page-level prefix cache: exact matches, references, leaf-first LRU eviction, integrity."""

from __future__ import annotations

import pytest

from engine.errors import CapacityError
from engine.page_allocator import PageAllocator
from engine.prefix_cache import PrefixCache
from tandem.page_keys import page_keys

PS = 4


def _cache(num_pages: int = 16) -> PrefixCache:
    return PrefixCache(PageAllocator(num_pages), PS)


def _prefill(cache: PrefixCache, tokens: list[int], namespace: str = "") -> tuple[list[int], int]:
    """What the scheduler does: match, allocate the rest, 'compute', insert. Returns (pages, matched)."""
    matched = cache.match(tokens, namespace)
    pages = matched + cache.allocate(-(-len(tokens) // PS) - len(matched))
    cache.insert(tokens, pages, len(matched), namespace)
    return pages, len(matched)


def test_a_repeated_prompt_reuses_its_full_pages_but_one_token_is_always_computed() -> None:
    cache = _cache()
    prompt = list(range(10))                     # pages [0..3] [4..7] and a partial [8, 9]
    pages, matched = _prefill(cache, prompt)
    assert matched == 0 and cache.num_cached_pages == 2
    cache.release(pages)
    assert cache.allocator.num_free == 16 - 2 and cache.num_evictable_pages == 2
    again, matched = _prefill(cache, prompt)
    assert matched == 2 and again[:2] == pages[:2]
    exact = list(range(8))                       # two full pages: the last one must be recomputed
    assert cache.match(exact) == pages[:1]
    cache.check_integrity()


def test_kv_computed_under_one_adapter_is_never_matched_under_another_or_none() -> None:
    cache = _cache(32)
    prompt = list(range(13))
    base, _ = _prefill(cache, prompt)
    under_a, matched = _prefill(cache, prompt, "adapter-a#1")
    assert matched == 0 and not set(under_a) & set(base)
    under_b, matched = _prefill(cache, prompt, "adapter-b#1")
    assert matched == 0 and not set(under_b) & (set(base) | set(under_a))
    assert _prefill(cache, prompt, "adapter-a#1")[1] == 3  # its own namespace matches
    assert _prefill(cache, prompt)[1] == 3
    for pages in (base, under_a, under_b):
        cache.release(pages)
    assert cache.evict(100) > 0
    cache.check_integrity()


def test_a_different_prefix_never_matches_a_later_page() -> None:
    cache = _cache()
    pages, _ = _prefill(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert cache.match([0, 2, 3, 4, 5, 6, 7, 8, 9]) == []          # first page differs
    assert cache.match([1, 2, 3, 4, 0, 6, 7, 8, 9]) == pages[:1]   # diverges in the second page
    cache.check_integrity()


def test_eviction_frees_unused_leaves_least_recently_used_first_and_keeps_pages_in_use() -> None:
    cache = _cache(num_pages=6)
    a, _ = _prefill(cache, list(range(100, 109)))     # 3 pages, 2 cached
    b, _ = _prefill(cache, list(range(200, 209)))     # 3 pages, 2 cached
    cache.release(a)                                   # its partial page is freed, two pages stay cached
    assert cache.allocator.num_free == 1 and cache.num_evictable_pages == 2
    got = cache.allocate(2)                            # must evict one page: a's leaf, not its root
    assert a[1] in got and a[0] not in got
    assert cache.match(list(range(100, 109))) == [a[0]]
    cache.release([a[0]])
    with pytest.raises(CapacityError):                 # b's pages are in use and stay
        cache.allocate(2)
    cache.release(b)
    assert cache.flush() == 3 and cache.num_cached_pages == 0
    cache.allocator.free(got)
    assert cache.allocator.num_free == 6
    cache.check_integrity()


def test_the_same_prompt_prefilled_twice_at_once_caches_one_copy() -> None:
    cache = _cache()
    tokens = list(range(9))
    first = cache.allocate(3)
    second = cache.allocate(3)
    cache.insert(tokens, first, 0)
    cache.insert(tokens, second, 0)    # key already cached: these stay private
    cache.release(second)
    assert cache.allocator.num_free == 16 - 3 and cache.num_cached_pages == 2
    with pytest.raises(ValueError):
        cache.release([first[0]]) or cache.release([first[0]])
    cache.check_integrity()


def test_kv_events_name_pages_by_the_routers_page_keys() -> None:
    cache = _cache(num_pages=4)
    first = list(range(12))                      # three full pages
    pages, _ = _prefill(cache, first)            # not recording: no event kept
    assert cache.take_events() == ([], [])
    assert cache.page_keys() == list(page_keys(first, PS))
    cache.release(pages)
    cache.is_recording_events = True
    adapted = [7] * 8
    pages, _ = _prefill(cache, adapted, "sql#3")  # the adapter's id names its load; the key names the adapter
    stored, removed = cache.take_events()
    assert stored == list(page_keys(adapted, PS, "sql")) and len(removed) == 1   # one of `first`'s, evicted
    assert removed[0] in page_keys(first, PS) and removed[0] not in cache.page_keys()
    assert cache.take_events() == ([], [])
    cache.release(pages)
    cache.flush()
    assert sorted(cache.take_events()[1]) == sorted(page_keys(first, PS)[:2] + page_keys(adapted, PS, "sql"))
    assert cache.page_keys() == []
