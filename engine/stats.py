"""`EngineStats`: a snapshot of an engine's queues and page pool, taken on the engine thread."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counts at one moment (`Engine.stats()`); a value, safe to hand to any thread."""

    num_running: int  # requests admitted: decoding, or part-way through their prompt's chunks
    num_waiting: int  # requests not admitted yet (new prompts, preempted ones to recompute), loading ones too
    num_free_pages: int
    num_total_pages: int
    num_cached_pages: int  # kept only by the prefix cache (reusable)
    num_preemptions: int  # running requests paused for lack of pages, since start
    num_draft_tokens: int = 0  # speculative draft tokens verified, since start
    num_accepted_tokens: int = 0  # of those, accepted as output
    tiers: tuple[TierStats, ...] = ()  # the prefix cache's tiers beyond the pool, fastest first
    num_loading: int = 0  # of the waiting, those whose cached pages are being read from a slow tier
    num_sending: int = 0  # prefill-only requests whose KV is being sent (their pages held until it is over)


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier of the prefix cache beyond the pool ("host", "disk" or "store": engine/kv_host_tier.py,
    engine/kv_disk_tier.py, engine/kv_store_tier.py): its pages now, and since start the pages saved to it,
    read back into the pool (cache hits it served), dropped as damaged, and lookups that failed (the store
    did not answer in time, or at all: misses it may have held); `num_pending`: saves still being written
    in the background (a lookup elsewhere misses them until they land)."""

    tier: str
    num_pages: int
    num_saved: int
    num_loaded: int
    num_dropped: int
    num_failed: int = 0
    num_pending: int = 0
