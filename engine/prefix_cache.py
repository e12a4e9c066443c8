"""Prefix cache at page granularity: a radix tree over full pages of prompt tokens. No torch.

A node is one KV page holding `page_size` tokens; its key is (parent page, those tokens), so a
match is exact (no hash collisions) and a page is reused only under the same prefix. Nodes count
the requests using them; unused nodes stay cached until the allocator needs their pages, then
leaves go first, least recently used first, so a cached child never outlives its parent.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from engine.errors import CapacityError
from engine.page_allocator import PageAllocator

_ROOT = -1


@dataclass(slots=True)
class _Node:
    page_id: int
    key: tuple[int, tuple[int, ...]]
    parent: int
    num_children: int = 0
    ref_count: int = 1
    last_access: int = 0


class PrefixCache:
    """Owns the pages of cached nodes; the allocator owns the rest. Single-threaded, like the engine."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._nodes: dict[int, _Node] = {}
        self._num_unused = 0          # nodes with ref_count 0, kept current on every transition
        self._clock = itertools.count(1)

    @property
    def num_cached_pages(self) -> int:
        return len(self._nodes)

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages no request uses (all reclaimable, leaves first). O(1): the scheduler asks often."""
        return self._num_unused

    def match(self, token_ids: list[int]) -> list[int]:
        """Pages holding the longest cached prefix of `token_ids` (at most len - 1 tokens, so one
        token is always computed). Each returned page gains a reference; `release` drops it."""
        pages: list[int] = []
        parent, now = _ROOT, next(self._clock)
        for start in range(0, len(token_ids) - 1 - self.page_size + 1, self.page_size):
            page_id = self._by_key.get((parent, tuple(token_ids[start:start + self.page_size])))
            if page_id is None:
                break
            node = self._nodes[page_id]
            if node.ref_count == 0:
                self._num_unused -= 1
            node.ref_count += 1
            node.last_access = now
            pages.append(page_id)
            parent = page_id
        return pages

    def insert(self, token_ids: list[int], page_ids: list[int], num_matched_pages: int) -> None:
        """Cache the full pages of a prompt whose KV has just been computed into `page_ids`.

        The first `num_matched_pages` came from `match`; the caller's reference to each newly
        cached page becomes the node's first reference. A page whose key is already cached (the
        same prompt prefilled concurrently) stays private to the request.
        """
        parent = page_ids[num_matched_pages - 1] if num_matched_pages else _ROOT
        now = next(self._clock)
        for index in range(num_matched_pages, len(token_ids) // self.page_size):
            key = (parent, tuple(token_ids[index * self.page_size:(index + 1) * self.page_size]))
            if key in self._by_key:
                return
            page_id = page_ids[index]
            self._nodes[page_id] = _Node(page_id, key, parent, last_access=now)
            self._by_key[key] = page_id
            if parent != _ROOT:
                self._nodes[parent].num_children += 1
            parent = page_id

    def release(self, page_ids: list[int]) -> None:
        """A request stops using these pages: cached ones lose a reference, others are freed."""
        private = []
        for page_id in page_ids:
            node = self._nodes.get(page_id)
            if node is None:
                private.append(page_id)
            else:
                if node.ref_count <= 0:
                    raise ValueError(f"cached page {page_id} released more often than referenced")
                node.ref_count -= 1
                if node.ref_count == 0:
                    self._num_unused += 1
        self.allocator.free(private)

    def can_allocate(self, num: int) -> bool:
        return self.allocator.num_free + self.num_evictable_pages >= num

    def allocate(self, num: int) -> list[int]:
        """Pages from the allocator, evicting unused cached leaves when it runs short. Raises
        CapacityError, evicting nothing, when even eviction could not make room."""
        if not self.can_allocate(num):
            raise CapacityError(f"need {num} KV pages; {self.allocator.num_free} free and "
                                f"{self.num_evictable_pages} reusable of {self.allocator.num_pages}")
        if num > self.allocator.num_free:
            self.evict(num - self.allocator.num_free)
        return self.allocator.allocate(num)

    def evict(self, num: int) -> int:
        """Free up to `num` pages of unused leaves (LRU first); returns how many were freed."""
        leaves = [(n.last_access, n.page_id) for n in self._nodes.values() if n.ref_count == 0 and n.num_children == 0]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < num:
            _, page_id = heapq.heappop(leaves)
            node = self._nodes.pop(page_id)
            self._num_unused -= 1
            del self._by_key[node.key]
            self.allocator.free([page_id])
            freed += 1
            if node.parent != _ROOT:
                parent = self._nodes[node.parent]
                parent.num_children -= 1
                if parent.num_children == 0 and parent.ref_count == 0:
                    heapq.heappush(leaves, (parent.last_access, parent.page_id))
        return freed

    def flush(self) -> int:
        """Drop every unused node; returns the pages freed. Nodes in use are kept."""
        return self.evict(len(self._nodes))

    def check_integrity(self) -> None:
        """Raise AssertionError if the tree's bookkeeping is inconsistent (for tests)."""
        children: dict[int, int] = {}
        for page_id, node in self._nodes.items():
            assert self._by_key[node.key] == page_id and node.ref_count >= 0
            assert node.parent == _ROOT or node.parent in self._nodes, f"orphan page {page_id}"
            children[node.parent] = children.get(node.parent, 0) + 1
        for page_id, node in self._nodes.items():
            assert node.num_children == children.get(page_id, 0), f"child count of page {page_id}"
        assert len(self._by_key) == len(self._nodes)
        assert self._num_unused == sum(1 for n in self._nodes.values() if n.ref_count == 0), "unused count"
