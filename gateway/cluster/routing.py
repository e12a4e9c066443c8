"""Where each request goes: which decode worker, and which prefill worker (or none: its decode worker
prefills it), by the `--router-policy` (`RouterPolicy`).

- round_robin: each role's candidates in turn.
- least_load: the candidate with the fewest requests on it (`Worker.queue_load`: this gateway's in
  flight, counted from the moment of the decision so that a burst spreads before any worker reports,
  plus what others put there at its last report); a decode worker then by the most free pages.
- prefix_aware: each role where the prompt's page-aligned prefix is most likely cached, unless that
  worker has more than `prefix_load_guard` requests in flight beyond the least loaded one: then the
  best match among those within the guard. A worker whose KV events are live (`Worker.event_index`,
  fed by `gateway/cluster/kv_events.py`) is read exactly: what its events say it holds, plus the
  prompts routed there in the last few seconds (their events lag). Any other is guessed (a
  `PrefixIndex` per worker, kept apart per role): a prefill worker's index learns the prompts sent
  there and is corrected by the `cached_tokens` each prefill reports; a decode worker's learns the
  prompts sent there, is corrected by the `cached_tokens` its Reserve (or its own prefill, for a local
  trip) reports, and learns each finished request's sequence, prompt and output, which the worker
  caches. The guess learns even while the events are live, to be ready when they stop. A prompt no worker holds
  goes to the least loaded: a prefill worker then to the one whose index holds least (so new
  prefixes spread over the workers), a decode worker then to the one with the most free pages.

Ties break deterministically: by the candidates' order (the pool's), and for prefixes no prefill
worker holds, by a hash of the prompt's first page and the worker's address. Conditional
disaggregation (`local_reason`) is decided once the decode worker is chosen: a prompt of which that
worker likely lacks fewer than `local_prefill_threshold` tokens (the prompt less what its index says
it holds; the whole prompt when nothing, as under round_robin and least_load), or one arriving while
every prefill worker it may be paired with has `prefill_busy_threshold` requests or more, is
prefilled by the decode worker. Event loop only.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.cluster.prefix_index import EventIndex, PrefixIndex, PromptPages, page_hashes
from gateway.cluster.worker import Worker
from gateway.config import RouterPolicy, RoutingConfig
from gateway.records import Role


class RouteReason(enum.StrEnum):
    """Why a worker was chosen (a metric label)."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    PREFIX_MATCH = "prefix_match"  # the candidate most likely to hold the prompt's prefix
    LOAD_GUARD = "load_guard"  # a better match was skipped: it had too many requests in flight
    SHORT_PROMPT = "short_prompt"  # no prefill worker: the prompt is under --local-prefill-threshold
    DECODE_CACHED = "decode_cached"  # no prefill worker: what the decode worker lacks of it is under the threshold
    PREFILL_BUSY = "prefill_busy"  # no prefill worker: every one is at --prefill-busy-threshold


@dataclass(slots=True)
class Route:
    """One request's workers. `prefill` None: the decode worker prefills the prompt itself. Each
    worker counts the request in its `num_in_flight` from `begin` until `end_prefill` (the prefill
    worker, once it answered) and `end` (both). `estimated_cached_tokens` and `page_hashes` are the
    prefill worker's estimate and the prompt's pages as its index names them; the `*decode*` ones the
    decode worker's (prefix_aware only: 0 and () under the other policies)."""

    prefill: Worker | None
    decode: Worker
    policy: RouterPolicy
    prefill_reason: RouteReason
    decode_reason: RouteReason
    estimated_cached_tokens: int = 0
    page_hashes: tuple[int, ...] = ()
    estimated_decode_cached_tokens: int = 0
    decode_page_hashes: tuple[int, ...] = ()
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
    """The routing policy and its state: round-robin turns and a guessed `PrefixIndex` per worker, kept
    apart per role (one address could serve both); each `Worker` brings its own `event_index`."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}
        # role -> address -> (its ready turns, index)
        self._indexes: dict[Role, dict[str, tuple[int, PrefixIndex]]] = {role: {} for role in Role}

    def local_reason(
        self, prompt_len: int, decode_cached_tokens: int, prefills: Sequence[Worker]
    ) -> RouteReason | None:
        """Why the chosen decode worker should prefill this prompt itself, given the leading tokens it
        likely holds (`decode_cached_tokens`) and the prefill workers it may be paired with (`prefills`);
        None: a prefill worker should."""
        threshold, busy = self.config.local_prefill_threshold, self.config.prefill_busy_threshold
        if threshold and prompt_len < threshold:
            return RouteReason.SHORT_PROMPT
        if threshold and prompt_len - decode_cached_tokens < threshold:
            return RouteReason.DECODE_CACHED
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

    def choose_decode(self, prompt: PromptPages, candidates: Sequence[Worker]) -> _Choice:
        """A decode worker among `candidates` (not empty), by the policy: round-robin; the least loaded
        (fewest requests, then most free pages; then the first); or by prefix, as `choose_prefill`."""
        policy = self.config.policy
        if policy is RouterPolicy.ROUND_ROBIN:
            return _Choice(candidates[next(self._turns["decode"]) % len(candidates)], RouteReason.ROUND_ROBIN)
        if policy is RouterPolicy.LEAST_LOAD:
            return _Choice(min(candidates, key=_decode_load), RouteReason.LEAST_LOAD)
        return self._by_prefix(prompt, candidates)

    def routed(self, route: Route) -> None:
        """The route's first call is sent (a handoff's reservation is held, or a local prefill
        starts): the prompt's pages will be in its prefill worker's cache once it ran there, and in its
        decode worker's. A route chosen but never used is not told here."""
        if route.prefill is not None and route.page_hashes:
            self._learn(route.prefill, route.page_hashes)
        if route.decode_page_hashes:
            self._learn(route.decode, route.decode_page_hashes)

    def prefilled(self, route: Route, cached_tokens: int) -> None:
        """The prefill worker answered with `cached_tokens` served from its cache: correct its index
        (a guess; live events are the truth)."""
        if route.prefill is not None and route.page_hashes:
            self._correct(route.prefill, route.page_hashes, route.estimated_cached_tokens, cached_tokens)

    def decode_matched(self, route: Route, cached_tokens: int) -> None:
        """The decode worker reported `cached_tokens` of the prompt already held (its Reserve's answer,
        or a local prefill's first chunk): correct its index (a guess; live events are the truth)."""
        if route.decode_page_hashes:
            self._correct(route.decode, route.decode_page_hashes, route.estimated_decode_cached_tokens, cached_tokens)

    def finished(self, route: Route, token_ids: Sequence[int], lora_name: str) -> None:
        """The request finished on its decode worker, whose sequence was `token_ids` (the prompt, then
        every output token) under the adapter `lora_name`: the worker caches the full pages of every
        token but the last (sampled last, its KV never computed). prefix_aware only."""
        if self.config.policy is RouterPolicy.PREFIX_AWARE:
            self._learn(route.decode, page_hashes(token_ids[:-1], _page_size(route.decode), lora_name))

    def forget_all(self) -> None:
        """Every prefix cache was flushed: the guesses are emptied (live events report what left)."""
        for indexes in self._indexes.values():
            for _, index in indexes.values():
                index.clear()

    def _by_prefix(self, prompt: PromptPages, candidates: Sequence[Worker]) -> _Choice:
        """The candidate whose index holds most of the prompt, among those within the load guard; among
        equals the least loaded, then a prefill worker by the smallest index and a rendezvous hash, a
        decode worker by the most free pages (then the first)."""
        page_size = _page_size(candidates[0])
        hashes = prompt.hashes(page_size)
        # The worker's cache always leaves a prompt's last token to compute, so at most this much of it hits.
        most = (len(prompt) - 1) // page_size
        matched = {w.address: min(most, self._index(w).match(hashes)) for w in candidates}
        least = min(w.queue_load for w in candidates)
        within = [w for w in candidates if w.queue_load <= least + self.config.prefix_load_guard]
        first_page = hashes[0] if hashes else hash(tuple(prompt.token_ids))

        def preference(w: Worker) -> tuple[int, int, int, int]:
            if w.role is Role.DECODE:
                return (-matched[w.address], w.queue_load, -w.num_free_pages, 0)
            return (-matched[w.address], w.queue_load, len(self._index(w)), _tie_break(first_page, w.address))

        best = min(within, key=preference)
        if matched[best.address] < max(matched.values()):
            reason = RouteReason.LOAD_GUARD
        elif not matched[best.address]:
            reason = RouteReason.LEAST_LOAD
        else:
            reason = RouteReason.PREFIX_MATCH
        return _Choice(best, reason, matched[best.address] * page_size, hashes)

    def _correct(self, worker: Worker, hashes: tuple[int, ...], estimated_tokens: int, real_tokens: int) -> None:
        page_size = _page_size(worker)
        self._index(worker).correct(hashes, estimated_tokens // page_size, real_tokens // page_size)

    def _index(self, worker: Worker) -> PrefixIndex | EventIndex:
        """The worker's index as routing reads it: its `event_index` while its KV events are live (and
        it keeps a prefix cache), else the guess."""
        has_cache = worker.info is None or not worker.info.prefix_cache_disabled
        return worker.event_index if worker.event_index.is_live and has_cache else self._guess(worker)

    def _learn(self, worker: Worker, hashes: Sequence[int]) -> None:
        """The worker was sent (or finished) a sequence with these page keys: its guess learns them and
        so, while live, does its event index (they count as held until its events catch up)."""
        self._guess(worker).insert(hashes)
        if worker.event_index.is_live:
            worker.event_index.insert(hashes)

    def _guess(self, worker: Worker) -> PrefixIndex:
        """The worker's guessed index (its role's), emptied when it has turned ready again since (a
        restart empties its cache)."""
        indexes = self._indexes[worker.role]
        turns, index = indexes.get(worker.address, (-1, None))
        if index is None or turns != worker.num_ready_changes:
            num_pages = worker.info.num_pages if worker.info is not None and worker.info.num_pages else 1 << 16
            has_cache = worker.info is None or not worker.info.prefix_cache_disabled
            index = PrefixIndex(num_pages) if has_cache else _NothingCached(num_pages)
            indexes[worker.address] = (worker.num_ready_changes, index)
        return index


class _NothingCached(PrefixIndex):
    """The index of a worker that keeps no prefix cache: it never holds a prompt's pages."""

    def match(self, hashes: Sequence[int]) -> int:
        return 0

    def insert(self, hashes: Sequence[int]) -> None:
        pass


def _decode_load(worker: Worker) -> tuple[int, int]:
    """Fewest requests first, then most free pages."""
    return (worker.queue_load, -worker.num_free_pages)


def _page_size(worker: Worker) -> int:
    return worker.info.kv_layout.page_size if worker.info is not None and worker.info.kv_layout.page_size else 16


def _tie_break(first_page: int, address: str) -> int:
    """Rendezvous hashing: each prompt prefix ranks the workers in its own stable order."""
    digest = hashlib.blake2b(f"{first_page}/{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
