"""The router's views of a worker's prefix cache: page keys (the workers' own, `tandem.page_keys`), the
guess (leading matches, least-recently-routed eviction of the deepest pages first, and correction from
the cached tokens the worker reports) and the exact index its KV events feed (a snapshot replaces it,
deltas apply, routed prompts count as held a while)."""

from __future__ import annotations

import pytest

from gateway.cluster.prefix_index import EventIndex, PrefixIndex, PromptPages, page_hashes
from gateway.cluster.worker_records import KvEvents
from tandem.page_keys import next_key, page_keys, root_key

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


def test_page_hashes_are_the_workers_page_keys() -> None:
    tokens = list(range(40))
    for lora_name in ("", "sql"):
        keys = page_hashes(tokens, 16, lora_name)
        assert keys == page_keys(tokens, 16, lora_name) and len(keys) == 2
        assert keys[1] == next_key(next_key(root_key(lora_name), tokens[:16]), tokens[16:32])
    assert page_hashes(tokens, 16, "sql") != page_hashes(tokens, 16)
    # fixed across processes and runs (unlike Python's hash() of a str): a key the workers publish
    assert page_hashes([1] * 4, 4) == (0x9B9D3B7F3596F49E,)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_snapshot_replaces_what_the_events_said_and_deltas_apply() -> None:
    a, b = page_hashes(list(range(48)), 16), page_hashes([7] * 48, 16)
    index = EventIndex()
    index.apply(KvEvents(False, stored=a))   # a delta before any snapshot: not the whole picture
    assert not index.is_live and index.match(a) == 0
    index.apply(KvEvents(True, stored=a))
    assert index.is_live and index.match(a) == 3 and len(index) == 3
    index.apply(KvEvents(False, stored=b[:2], removed=a[1:2]))
    assert (index.match(a), index.match(b)) == (1, 2)   # the leading keys only: a's third is held, its second not
    index.apply(KvEvents(True, stored=b))   # a restarted worker's new stream: what was known is forgotten
    assert (index.match(a), index.match(b), len(index)) == (0, 3, 3)
    index.lose()
    assert not index.is_live and len(index) == 0


def test_a_routed_prompt_counts_as_held_until_its_events_come_or_its_hold_ends() -> None:
    clock, a, b = _Clock(), page_hashes(list(range(48)), 16), page_hashes([7] * 48, 16)
    index = EventIndex(hold_s=5.0, clock=clock)
    index.apply(KvEvents(True))
    index.insert(a)
    index.insert(b)
    assert (index.match(a), index.match(b)) == (3, 3)
    index.apply(KvEvents(False, stored=a[:2], removed=b[:1]))   # a's pages arrive; b's first was evicted
    assert (index.match(a), index.match(b)) == (3, 0)
    clock.now += 5.0   # the hold is over: only what the events said stays
    assert (index.match(a), index.match(b), len(index)) == (2, 0, 2)
    index.correct(a, estimated_pages=2, real_pages=0)   # events are the truth: a report changes nothing
    assert index.match(a) == 2
    index.insert(b)
    index.clear()   # a flush: the worker's events will say what left; the routed guesses go now
    assert (index.match(a), index.match(b)) == (2, 0)
