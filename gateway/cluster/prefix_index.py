"""The gateway's indexes of what one worker's prefix cache holds (one per prefill and per decode
worker: `gateway/cluster/routing.py`).

The worker's cache (engine/prefix_cache.py) holds full pages of tokens, keyed by the page and
everything before it. `page_hashes` names each full page of a prompt by its page key
(`tandem.page_keys`: a hash chained over every page up to it from the LoRA adapter's name, the same
in every process), so one key stands for a whole prefix, two prompts share a key exactly when they
share that many pages, and the same tokens under another adapter (or none) share no page.

`EventIndex` is exact: the keys the worker's KV events say it holds (`gateway/cluster/kv_events.py`
feeds it), plus, for a few seconds, the prompts just routed there (their events lag).

`PrefixIndex` is the guess for a worker with no live event stream (one too old to publish them, or
between two streams): the page-aligned prefixes the gateway routed to the worker, bounded (at most
the worker's pool, in pages), the least recently routed prefix evicted first, deepest pages first,
as the worker's own cache evicts leaves first. Each answer that reports cache hits (a prefill's, a
decode worker's Reserve or local prefill) corrects it (`correct`): the worker's `cached_tokens` says
how much of the prompt it really held, so an index that promised more shrinks towards the worker's
real cache, and one that promised less (another gateway sent that prefix there) grows.

No I/O; event loop only.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Sequence

from gateway.cluster.worker_records import KvEvents
from tandem.page_keys import page_keys

# How long a prompt routed to a worker with live KV events counts as held there before its own stored
# events arrive: they come about every 0.25 s once its prefill ran, which may first queue a while.
ROUTED_HOLD_S = 5.0


def page_hashes(token_ids: Sequence[int], page_size: int, lora_name: str = "") -> tuple[int, ...]:
    """One page key (`tandem.page_keys.page_keys`) per full page of `token_ids`: key i stands for the
    prefix of pages 0..i, run under the adapter `lora_name` ("" the base model). The workers publish
    their cached pages under the same keys."""
    return page_keys(token_ids, page_size, lora_name)


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


class EventIndex:
    """The pages one worker's KV events say its prefix cache holds, exact while `is_live` (a snapshot
    arrived on the stream open now; `gateway/cluster/kv_events.py`). A prompt routed there (`insert`)
    counts as held for `hold_s` seconds unless its keys arrive as stored (then they are held until
    removed) or removed first. Same reading interface as `PrefixIndex`; `correct` does nothing (the
    events are the truth)."""

    def __init__(self, hold_s: float = ROUTED_HOLD_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.is_live = False
        self._hold_s = hold_s
        self._clock = clock
        self._held: set[int] = set()  # what the events say
        self._routed: collections.OrderedDict[int, float] = collections.OrderedDict()  # key -> until; oldest first

    def __len__(self) -> int:
        self._expire()
        return len(self._held) + len(self._routed)

    def apply(self, events: KvEvents) -> None:
        """One message of the worker's stream: a snapshot replaces what the events said (and makes the
        index live); a delta adds its stored keys and takes out its removed ones. A delta before any
        snapshot is dropped. Either way a key the events name is no longer only routed."""
        if events.is_snapshot:
            self._held = set(events.stored)
            self.is_live = True
        elif self.is_live:
            self._held.update(events.stored)
            self._held.difference_update(events.removed)
        else:
            return
        for key in itertools.chain(events.stored, events.removed):
            self._routed.pop(key, None)

    def lose(self) -> None:
        """The stream broke: no longer live until the next snapshot (the router guesses meanwhile)."""
        self.is_live = False
        self._held.clear()

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading pages of the prompt with these `hashes` the worker holds (or was just sent)."""
        self._expire()
        num_pages = 0
        for key in hashes:
            if key not in self._held and key not in self._routed:
                break
            num_pages += 1
        return num_pages

    def insert(self, hashes: Sequence[int]) -> None:
        """The prompt was routed here: its pages not yet held count as held for the next `hold_s` s."""
        until = self._clock() + self._hold_s
        for key in hashes:
            if key not in self._held:
                self._routed[key] = until
                self._routed.move_to_end(key)
        self._expire()

    def correct(self, hashes: Sequence[int], estimated_pages: int, real_pages: int) -> None:
        """Nothing: the worker's events say what it holds."""

    def clear(self) -> None:
        """The caches were flushed: forget the prompts routed here; the worker's events remove the rest."""
        self._routed.clear()

    def _expire(self) -> None:
        now = self._clock()
        while self._routed and next(iter(self._routed.values())) <= now:
            self._routed.popitem(last=False)
