"""Prefix cache at page granularity: a radix tree over full pages of tokens with KV. No torch.

A node is one KV page holding `page_size` tokens; its key is (parent page, those tokens), so a
match is exact (no hash collisions) and a page is reused only under the same prefix. A prompt's
first page hangs from its namespace's root: KV computed under a LoRA adapter (namespace: the
adapter's id) is never matched by a prompt under another adapter or none (""). Nodes count
the requests using them; unused nodes stay cached until the allocator needs their pages, then
leaves go first, least recently used first, so a cached child never outlives its parent. A prompt
joins the cache once its KV is computed, and a finished request's whole sequence (its output too) when
it ends, so a chat's next turn, whose prompt repeats the last one and its answer, finds both.

Eviction candidates (unused leaves) are kept in a heap as they appear, so an eviction costs
O(log nodes), not a scan of the tree. Entries are not removed when a leaf stops being a
candidate (a match uses it, or it is evicted); `_pop_evictable` skips such stale entries, and
the heap is rebuilt when stale ones outnumber the nodes.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from engine.errors import CapacityError
from engine.page_allocator import PageAllocator
from engine.page_pool import PagePool
from tandem.page_keys import next_key, root_key

DIGEST_BYTES = 16


@dataclass(frozen=True, slots=True)
class PageRead:
    """One page read from a slow tier by digest, checked: its bytes (None: not there, or damaged) and, for
    a damaged page, what is wrong with it."""

    payload: bytes | None
    problem: str = ""


class PageTier(Protocol):
    """Where cached pages are kept beyond the pool, by `page_digest` (engine/kv_host_tier.py's `TierChain`)."""

    def root(self, namespace: str) -> bytes: ...
    def contains(self, digest: bytes) -> bool: ...
    def save(self, digest: bytes, page_id: int) -> None: ...
    def load(self, digest: bytes, page_id: int) -> bool: ...


_ROOT = -1  # the base model's root; each other namespace gets a root of its own below it (-2, -3, ...)


def _adapter_name(namespace: str) -> str:
    """The LoRA adapter's name in a cache namespace (its id, `name#load`: server_runtime/lora_serving.py)."""
    return namespace.rpartition("#")[0] if "#" in namespace else namespace


def page_digest(parent: bytes, tokens: tuple[int, ...] | list[int]) -> bytes:
    """A page's name in the disk tier: a hash of `tokens` chained from the name `parent` of the page
    before it (or of its namespace's root), so it stands for every token up to the page's last."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}i", *tokens), digest_size=DIGEST_BYTES).digest()


@dataclass(slots=True)
class _Node:
    page_id: int
    key: tuple[int, tuple[int, ...]]
    parent: int
    num_children: int = 0
    ref_count: int = 1
    last_access: int = 0
    digest: bytes = b""  # its name in the disk tier (engine/kv_disk_tier.py); b"" without one
    route_key: int = 0  # its page key (tandem/page_keys.py): its name in KV events and the gateway's router

    @property
    def is_evictable(self) -> bool:
        return self.ref_count == 0 and self.num_children == 0


class PrefixCache(PagePool):
    """Owns the pages of cached nodes; the allocator owns the free ones. Single-threaded, like the engine."""

    def __init__(self, allocator: PageAllocator, page_size: int, tier: PageTier | None = None) -> None:
        super().__init__(allocator, page_size)
        self.tier = tier
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._nodes: dict[int, _Node] = {}
        self._num_unused = 0  # nodes with ref_count 0, kept current on every transition
        self._clock = itertools.count(1)
        # (last_access, page_id) of every unused leaf, plus stale entries: those whose node is gone,
        # was touched since (its last_access moved on), or is no longer an unused leaf
        self._evictable: list[tuple[int, int]] = []
        self._roots: dict[str, int] = {"": _ROOT}
        self._stored: list[int] = []
        self._removed: list[int] = []

    @property
    def num_cached_pages(self) -> int:
        return len(self._nodes)

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages no request uses (all reclaimable, leaves first). O(1): the scheduler asks often."""
        return self._num_unused

    def _root(self, namespace: str) -> int:
        return self._roots.setdefault(namespace, _ROOT - len(self._roots))

    def match(self, token_ids: list[int], namespace: str = "") -> list[int]:
        """Pages holding the longest cached prefix of `token_ids` in `namespace` (at most len - 1
        tokens, so one token is always computed). Each returned page gains a reference; `release`
        drops it."""
        pages: list[int] = []
        parent, now = self._root(namespace), next(self._clock)
        starts = range(0, len(token_ids) - 1 - self.page_size + 1, self.page_size)
        for start in starts:
            page_id = self._by_key.get((parent, tuple(token_ids[start : start + self.page_size])))
            if page_id is None:
                break
            node = self._nodes[page_id]
            if node.ref_count == 0:
                self._num_unused -= 1
            node.ref_count += 1
            node.last_access = now
            pages.append(page_id)
            parent = page_id
        if self.tier is not None and not namespace and len(pages) < len(starts):
            pages += self._load_from_tier(token_ids, starts[len(pages) :], parent, namespace, now)
        return pages

    def missing_digests(self, token_ids: list[int], namespace: str = "") -> list[bytes]:
        """The names of the full pages of `token_ids` (at most len - 1 tokens, as `match`) after the longest
        prefix the pool and the tier's fast part hold now: what a fetch from the slow tiers would look for.
        Touches no reference. Empty without a tier, and in a LoRA namespace (the tiers keep the base model's
        pages only)."""
        if self.tier is None or namespace:
            return []
        parent: int | None = self._root(namespace)  # None: past the pages the pool holds
        digest = self.tier.root(namespace)
        missing: list[bytes] = []
        for start in range(0, len(token_ids) - 1 - self.page_size + 1, self.page_size):
            tokens = tuple(token_ids[start : start + self.page_size])
            page_id = self._by_key.get((parent, tokens)) if parent is not None else None
            if page_id is not None:
                parent, digest = page_id, self._nodes[page_id].digest
                continue
            parent = None
            digest = page_digest(digest, tokens)
            if missing or not self.tier.contains(digest):
                missing.append(digest)
        return missing

    def _load_from_tier(self, token_ids: list[int], starts: range, parent: int, namespace: str, now: int) -> list[int]:
        """Go on matching in the disk tier from page `parent` (a node, or the namespace's root): each page
        found there is read into a newly allocated pool page and joins the tree, referenced by the caller."""
        assert self.tier is not None
        pages: list[int] = []
        digest = self._digest(parent, namespace)
        for start in starts:
            tokens = tuple(token_ids[start : start + self.page_size])
            digest = page_digest(digest, tokens)
            if not self.tier.contains(digest) or not self.can_allocate(1):
                break
            [page_id] = self.allocate(1)  # evicts only unused leaves: never a page this walk holds
            if not self.tier.load(digest, page_id):
                self.allocator.free([page_id])
                break
            self._add_node(_Node(page_id, (parent, tokens), parent, last_access=now, digest=digest), namespace)
            pages.append(page_id)
            parent = page_id
        return pages

    # The tiers keep the base model's pages only: an adapter's cache id (`name#load`) names one load in one
    # process, and the same id in another worker, or after a restart, may be other weights.
    def _digest(self, parent: int, namespace: str) -> bytes:
        """The disk tier's name of page `parent`, or of the root of `namespace` when `parent` is one."""
        assert self.tier is not None
        return self._nodes[parent].digest if parent >= 0 else self.tier.root(namespace)

    def _add_node(self, node: _Node, namespace: str) -> None:
        parent_key = self._nodes[node.parent].route_key if node.parent >= 0 else root_key(_adapter_name(namespace))
        node.route_key = next_key(parent_key, node.key[1])
        if self.is_recording_events:
            self._stored.append(node.route_key)
        self._nodes[node.page_id] = node
        self._by_key[node.key] = node.page_id
        if node.parent >= 0:
            self._nodes[node.parent].num_children += 1

    def insert(self, token_ids: list[int], page_ids: list[int], num_matched_pages: int, namespace: str = "") -> None:
        """Cache the full pages of a prompt whose KV has just been computed into `page_ids`, in `namespace`.

        The first `num_matched_pages` came from `match`; the caller's reference to each newly
        cached page becomes the node's first reference. A page already cached as this very node
        (inserted earlier by the same request: its prompt, then its whole sequence at its finish)
        is passed over. A page whose key is cached as another page (the same prompt prefilled
        concurrently) stays private to the request, and so do the pages after it.
        """
        parent = page_ids[num_matched_pages - 1] if num_matched_pages else self._root(namespace)
        now = next(self._clock)
        for index in range(num_matched_pages, len(token_ids) // self.page_size):
            key = (parent, tuple(token_ids[index * self.page_size : (index + 1) * self.page_size]))
            if (cached := self._by_key.get(key)) is not None:
                if cached != page_ids[index]:
                    return
                parent = cached
                continue
            page_id = page_ids[index]
            node = _Node(page_id, key, parent, last_access=now)
            if self.tier is not None and not namespace:  # a full page with its KV computed: kept beyond the pool
                node.digest = page_digest(self._digest(parent, namespace), key[1])
                self.tier.save(node.digest, page_id)
            self._add_node(node, namespace)
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
                    self._push_if_evictable(node)
        self.allocator.free(private)

    def allocate(self, num: int) -> list[int]:
        """Pages from the allocator, evicting unused cached leaves when it runs short. Raises
        CapacityError, evicting nothing, when even eviction could not make room."""
        if not self.can_allocate(num):
            raise CapacityError(
                f"need {num} KV pages; {self.allocator.num_free} free and "
                f"{self.num_evictable_pages} reusable of {self.allocator.num_pages}"
            )
        if num > self.allocator.num_free:
            self.evict(num - self.allocator.num_free)
        return self.allocator.allocate(num)

    def evict(self, num: int) -> int:
        """Free up to `num` pages of unused leaves (LRU first); returns how many were freed. A
        parent whose last child goes becomes a leaf and a candidate in the same call."""
        freed = 0
        while freed < num and (node := self._pop_evictable()) is not None:
            del self._nodes[node.page_id]
            del self._by_key[node.key]
            if self.is_recording_events:
                self._removed.append(node.route_key)
            self._num_unused -= 1
            self.allocator.free([node.page_id])
            freed += 1
            if node.parent >= 0:
                parent = self._nodes[node.parent]
                parent.num_children -= 1
                self._push_if_evictable(parent)
        return freed

    def flush(self) -> int:
        """Drop every unused node; returns the pages freed. Nodes in use are kept."""
        return self.evict(len(self._nodes))

    def cached_page_refs(self) -> Mapping[int, int]:
        return {page_id: node.ref_count for page_id, node in self._nodes.items()}

    def page_keys(self) -> list[int]:
        return [node.route_key for node in self._nodes.values()]

    def take_events(self) -> tuple[list[int], list[int]]:
        stored, removed, self._stored, self._removed = self._stored, self._removed, [], []
        return stored, removed

    def _push_if_evictable(self, node: _Node) -> None:
        if not node.is_evictable:
            return
        heapq.heappush(self._evictable, (node.last_access, node.page_id))
        if len(self._evictable) > 2 * len(self._nodes) + 16:  # mostly stale: keep memory O(nodes)
            self._evictable = [entry for entry in self._evictable if self._is_live(entry)]
            heapq.heapify(self._evictable)

    def _pop_evictable(self) -> _Node | None:
        """The least recently used unused leaf, taken off the heap; None when there is none."""
        while self._evictable:
            entry = heapq.heappop(self._evictable)
            if self._is_live(entry):
                return self._nodes[entry[1]]
        return None

    def _is_live(self, entry: tuple[int, int]) -> bool:
        """Whether a heap entry still names an unused leaf as it is now. `last_access` only grows,
        so an entry pushed before the node was last touched (or before its page was re-cached)
        never matches again."""
        last_access, page_id = entry
        node = self._nodes.get(page_id)
        return node is not None and node.last_access == last_access and node.is_evictable

    def check_integrity(self) -> None:
        """Raise AssertionError if the tree's bookkeeping is inconsistent (for tests): keys, child
        counts, the unused count, and that the heap's live entries are exactly the unused leaves."""
        super().check_integrity()
        children: dict[int, int] = {}
        for page_id, node in self._nodes.items():
            assert self._by_key[node.key] == page_id and node.ref_count >= 0
            assert node.parent < 0 or node.parent in self._nodes, f"orphan page {page_id}"
            children[node.parent] = children.get(node.parent, 0) + 1
        for page_id, node in self._nodes.items():
            assert node.num_children == children.get(page_id, 0), f"child count of page {page_id}"
        assert len(self._by_key) == len(self._nodes)
        assert self._num_unused == sum(1 for n in self._nodes.values() if n.ref_count == 0), "unused count"
        live = {entry for entry in self._evictable if self._is_live(entry)}
        leaves = {(n.last_access, n.page_id) for n in self._nodes.values() if n.is_evictable}
        assert live == leaves, f"eviction heap {sorted(live)} does not hold the unused leaves {sorted(leaves)}"
        heap = self._evictable
        assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), "eviction heap order"
