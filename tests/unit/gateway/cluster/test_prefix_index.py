"""The router's approximate view of a prefill worker's prefix cache: chained page hashes, leading
matches, least-recently-routed eviction of the deepest pages first, and correction from the cached
tokens the worker reports."""

from __future__ import annotations

import pytest

from gateway.cluster.prefix_index import PrefixIndex, PromptPages, page_hashes

PAGE = 4


def test_one_hash_per_full_page_each_standing_for_the_whole_prefix() -> None:
    a = page_hashes(list(range(10)), PAGE)                      # 2 full pages; the last 2 tokens are no page
    b = page_hashes(list(range(8)) + [99, 98, 97, 96], PAGE)
    c = page_hashes([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11], PAGE)
    assert len(a) == 2 and len(b) == 3 and a == b[:2]
    assert c[0] == a[0] and c[1] != a[1]
    # the same third page after a different second page is another prefix
    assert page_hashes(list(range(8)) + [8, 9, 10, 11], PAGE)[2] != c[2]
    assert page_hashes([1, 2, 3], PAGE) == ()


def test_a_prompts_hashes_are_computed_once_per_page_size() -> None:
    prompt = PromptPages(list(range(10)))
    first = prompt.hashes(PAGE)
    assert first == page_hashes(list(range(10)), PAGE) and prompt.hashes(PAGE) is first
    assert prompt.hashes(8) == page_hashes(list(range(10)), 8) and len(prompt) == 10


def test_a_match_counts_the_leading_pages_only() -> None:
    index = PrefixIndex(max_capacity=16)
    index.insert(page_hashes(list(range(12)), PAGE))
    assert index.match(page_hashes(list(range(12)), PAGE)) == 3
    assert index.match(page_hashes(list(range(8)) + [7, 7, 7, 7], PAGE)) == 2
    assert index.match(page_hashes([5] * 12, PAGE)) == 0


def test_the_least_recently_routed_prefix_goes_first_deepest_pages_first() -> None:
    index = PrefixIndex(max_capacity=5)
    old, new = page_hashes(list(range(12)), PAGE), page_hashes([50 + i for i in range(8)], PAGE)
    index.insert(old)
    index.insert(new)   # 3 + 2 pages: full
    assert len(index) == 5
    index.insert(page_hashes([90 + i for i in range(4)], PAGE))   # one more page: old's last page goes
    assert index.match(old) == 2 and index.match(new) == 2 and len(index) == 5


def test_the_reported_cached_tokens_correct_the_capacity() -> None:
    index = PrefixIndex(max_capacity=40)
    prompt = page_hashes(list(range(40)), PAGE)   # 10 pages
    index.insert(prompt)
    index.correct(prompt, estimated_pages=9, real_pages=3)   # the worker had evicted 6 of them
    assert index.capacity == 34 and index.match(prompt) == 10
    index.correct(prompt, estimated_pages=2, real_pages=9)   # more than routed here: someone else sent it
    assert index.capacity == 40
    index.correct(prompt, estimated_pages=40, real_pages=0)
    assert index.capacity == 10   # never below a quarter of the pool
    index.clear()
    assert len(index) == 0 and index.capacity == 40


def test_an_empty_pool_is_refused() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_the_same_tokens_under_another_adapter_share_no_page() -> None:
    tokens = list(range(48))
    base, a, b = (page_hashes(tokens, 16, name) for name in ("", "a", "b"))
    assert len(set(base) | set(a) | set(b)) == 9   # three pages each, none shared
    assert page_hashes(tokens, 16) == base and PromptPages(tokens, "a").hashes(16) == a
    index = PrefixIndex(64)
    index.insert(a)
    assert (index.match(a), index.match(b), index.match(base)) == (3, 0, 0)
