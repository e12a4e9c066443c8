"""Where each request goes: which prefill worker (or none: its decode worker prefills it) and which
decode worker, by the `--router-policy` (`RouterPolicy`).

- round_robin: each role's candidates in turn.
- least_load: the candidate with the fewest requests on it (`Worker.queue_load`: this gateway's in
  flight, counted from the moment of the decision so that a burst spreads before any worker reports,
  plus what others put there at its last report); a decode worker then by the most free pages.
- prefix_aware: prefill where the prompt's page-aligned prefix is most likely cached (`PrefixIndex`
  per worker, corrected by the `cached_tokens` each prefill reports), unless that worker has more
  than `prefix_load_guard` requests in flight beyond the least loaded one: then the best match among
  those within the guard. A prompt no worker holds goes to the least loaded, then the one whose index
  holds least (so new prefixes spread over the workers). Decode as least_load.

Ties break deterministically: by the candidates' order (the pool's), and for prefixes no worker holds,
by a hash of the prompt's first page and the worker's address. Conditional disaggregation
(`local_reason`): a prompt shorter than `local_prefill_threshold` tokens, or one arriving while every
prefill worker has `prefill_busy_threshold` requests or more, is prefilled by its decode worker. Decode
workers keep no prefix cache, so there every prompt token is uncached: the threshold is on the whole
prompt. Event loop only.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.cluster.prefix_index import PrefixIndex, PromptPages
from gateway.cluster.worker import Worker
from gateway.config import RouterPolicy, RoutingConfig


class RouteReason(enum.StrEnum):
    """Why a worker was chosen (a metric label)."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    PREFIX_MATCH = "prefix_match"  # the candidate most likely to hold the prompt's prefix
    LOAD_GUARD = "load_guard"  # a better match was skipped: it had too many requests in flight
    SHORT_PROMPT = "short_prompt"  # no prefill worker: the prompt is under --local-prefill-threshold
    PREFILL_BUSY = "prefill_busy"  # no prefill worker: every one is at --prefill-busy-threshold


@dataclass(slots=True)
class Route:
    """One request's workers. `prefill` None: the decode worker prefills the prompt itself. Each
    worker counts the request in its `num_in_flight` from `begin` until `end_prefill` (the prefill
    worker, once it answered) and `end` (both)."""

    prefill: Worker | None
    decode: Worker
    policy: RouterPolicy
    prefill_reason: RouteReason
    decode_reason: RouteReason
    estimated_cached_tokens: int = 0
    page_hashes: tuple[int, ...] = ()
    _holds: list[Worker] = field(default_factory=list)

    @property
    def is_local(self) -> bool:
        return self.prefill is None

    def begin(self) -> None:
        self._holds = [w for w in (self.prefill, self.decode) if w is not None]
        for worker in self._holds:
            worker.num_in_flight += 1

    def end_prefill(self) -> None:
        if self.prefill is not None and self.prefill in self._holds:
            self._holds.remove(self.prefill)
            self.prefill.num_in_flight -= 1

    def end(self) -> None:
        for worker in self._holds:
            worker.num_in_flight -= 1
        self._holds = []


@dataclass(frozen=True, slots=True)
class _Choice:
    worker: Worker
    reason: RouteReason
    estimated_cached_tokens: int = 0
    page_hashes: tuple[int, ...] = ()


class Router:
    """The routing policy and its state: round-robin turns and a `PrefixIndex` per prefill worker."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}
        self._indexes: dict[str, tuple[int, PrefixIndex]] = {}  # address -> (its ready turns, index)

    def local_reason(self, prompt_len: int, prefills: Sequence[Worker]) -> RouteReason | None:
        """Why the decode worker should prefill this prompt itself; None: a prefill worker should."""
        threshold, busy = self.config.local_prefill_threshold, self.config.prefill_busy_threshold
        if threshold and prompt_len < threshold:
            return RouteReason.SHORT_PROMPT
        if busy and prefills and all(w.queue_load >= busy for w in prefills):
            return RouteReason.PREFILL_BUSY
        return None

    def choose_prefill(self, prompt: PromptPages, candidates: Sequence[Worker]) -> _Choice:
        """A prefill worker among `candidates` (not empty), by the policy."""
        policy = self.config.policy
        if policy is RouterPolicy.ROUND_ROBIN:
            return _Choice(candidates[next(self._turns["prefill"]) % len(candidates)], RouteReason.ROUND_ROBIN)
        if policy is RouterPolicy.LEAST_LOAD:
            return _Choice(min(candidates, key=lambda w: w.queue_load), RouteReason.LEAST_LOAD)
        return self._by_prefix(prompt, candidates)

    def choose_decode(self, candidates: Sequence[Worker]) -> _Choice:
        """A decode worker among `candidates` (not empty): round-robin, or the least loaded (fewest
        requests, then most free pages; then the first)."""
        if self.config.policy is RouterPolicy.ROUND_ROBIN:
            return _Choice(candidates[next(self._turns["decode"]) % len(candidates)], RouteReason.ROUND_ROBIN)
        return _Choice(min(candidates, key=lambda w: (w.queue_load, -w.num_free_pages)), RouteReason.LEAST_LOAD)

    def routed(self, route: Route) -> None:
        """The route's prefill is sent (its reservation is held): the prompt's pages will be in its
        prefill worker's cache once it ran there. A route chosen but never used is not told here."""
        if route.prefill is not None and route.page_hashes:
            self._index(route.prefill).insert(route.page_hashes)

    def prefilled(self, route: Route, cached_tokens: int) -> None:
        """The prefill worker answered with `cached_tokens` served from its cache: correct its index."""
        if route.prefill is None or not route.page_hashes:
            return
        page_size = _page_size(route.prefill)
        self._index(route.prefill).correct(
            route.page_hashes, route.estimated_cached_tokens // page_size, cached_tokens // page_size
        )

    def forget_all(self) -> None:
        """Every prefix cache was flushed."""
        for _, index in self._indexes.values():
            index.clear()

    def _by_prefix(self, prompt: PromptPages, candidates: Sequence[Worker]) -> _Choice:
        page_size = _page_size(candidates[0])
        hashes = prompt.hashes(page_size)
        # The worker's cache always leaves a prompt's last token to compute, so at most this much of it hits.
        most = (len(prompt) - 1) // page_size
        matched = {w.address: min(most, self._index(w).match(hashes)) for w in candidates}
        least = min(w.queue_load for w in candidates)
        within = [w for w in candidates if w.queue_load <= least + self.config.prefix_load_guard]
        first_page = hashes[0] if hashes else hash(tuple(prompt.token_ids))

        def preference(w: Worker) -> tuple[int, int, int, int]:
            return (-matched[w.address], w.queue_load, len(self._index(w)), _tie_break(first_page, w.address))

        best = min(within, key=preference)
        if matched[best.address] < max(matched.values()):
            reason = RouteReason.LOAD_GUARD
        elif not matched[best.address]:
            reason = RouteReason.LEAST_LOAD
        else:
            reason = RouteReason.PREFIX_MATCH
        return _Choice(best, reason, matched[best.address] * page_size, hashes)

    def _index(self, worker: Worker) -> PrefixIndex:
        """The worker's index, emptied when it has turned ready again since (a restart empties its cache)."""
        turns, index = self._indexes.get(worker.address, (-1, None))
        if index is None or turns != worker.num_ready_changes:
            num_pages = worker.info.num_pages if worker.info is not None and worker.info.num_pages else 1 << 16
            index = PrefixIndex(num_pages)
            self._indexes[worker.address] = (worker.num_ready_changes, index)
        return index


def _page_size(worker: Worker) -> int:
    return worker.info.kv_layout.page_size if worker.info is not None and worker.info.kv_layout.page_size else 16


def _tie_break(first_page: int, address: str) -> int:
    """Rendezvous hashing: each prompt prefix ranks the workers in its own stable order."""
    digest = hashlib.blake2b(f"{first_page}/{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
