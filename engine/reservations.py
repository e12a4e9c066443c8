"""Pages held for prompts whose KV another process writes: the decode side of a handoff. No torch.

A reservation holds its pages from `Engine.reserve` until the engine admits its request (the
pages pass to the request), it is aborted, or its TTL runs out. Its leading pages may be the prefix
cache's (the prompt's cached prefix, shared with other requests): those are never written from
outside and go back at once whenever it ends. The pages of a reservation
dropped before admission may still be the target of a KV write in flight from a prefill server,
so unless the caller knows no write can still land they sit out `grace_s` seconds (quarantine)
before they are free again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.page_pool import PagePool

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Reservation:
    """`page_ids` cover the whole prompt in token order. The first `num_cached_pages` are prefix-cache
    pages this worker already held (matched in `namespace`, shared, never written from outside); the
    rest are private pages a prefill server writes."""

    page_ids: list[int]
    prompt_len: int
    expires_at: float  # time.monotonic() seconds
    grace_s: float
    num_cached_pages: int = 0
    namespace: str = ""

    @property
    def written_page_ids(self) -> list[int]:
        """The pages a prefill server writes: those after the cached prefix."""
        return self.page_ids[self.num_cached_pages :]


@dataclass(frozen=True, slots=True)
class ReservedPages:
    """What `Engine.reserve` answers: the pages to write (`page_ids`, from token `cached_tokens` on)
    and how many leading prompt tokens' KV this worker already holds (a whole number of pages)."""

    page_ids: list[int]
    cached_tokens: int = 0


class Reservations:
    """Reservations by request id, and the quarantined pages of dropped ones. Pages are returned
    through `pages` (written pages are never cached, so they are freed; cached ones lose a reference).
    Single-threaded, like the engine."""

    def __init__(self, pages: PagePool) -> None:
        self._pages = pages
        self._by_id: dict[str, Reservation] = {}
        self._quarantine: list[tuple[float, list[int]]] = []  # (reusable at, pages)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def ids(self) -> list[str]:
        return list(self._by_id)

    def add(self, request_id: str, reservation: Reservation) -> None:
        self._by_id[request_id] = reservation

    def get(self, request_id: str) -> Reservation | None:
        return self._by_id.get(request_id)

    def take(self, request_id: str) -> Reservation:
        """Remove a reservation whose pages pass to its admitted request (nothing is freed)."""
        return self._by_id.pop(request_id)

    def touch(self, request_id: str, expires_at: float) -> None:
        """Keep a reservation at least until `expires_at`; an unknown id is ignored."""
        reservation = self._by_id.get(request_id)
        if reservation is not None:
            reservation.expires_at = max(reservation.expires_at, expires_at)

    def drop(self, request_id: str, now: float, write_settled: bool = False) -> bool:
        """Remove a reservation and give its pages back, at once if `write_settled` says no KV
        write into them can still be in flight, else after its grace. False if there was none."""
        reservation = self._by_id.pop(request_id, None)
        if reservation is None:
            return False
        self._pages.release(reservation.page_ids[: reservation.num_cached_pages])  # no write aims at these
        if write_settled or reservation.grace_s <= 0:
            self._pages.release(reservation.written_page_ids)
        else:
            self._quarantine.append((now + reservation.grace_s, reservation.written_page_ids))
        return True

    def expire(self, now: float) -> list[str]:
        """Drop reservations past their TTL and free quarantined pages whose grace is over.
        Returns the ids of the expired reservations."""
        expired = [request_id for request_id, r in self._by_id.items() if r.expires_at <= now]
        for request_id in expired:
            self.drop(request_id, now)
            logger.warning("reservation for %s expired unused; its pages are released", request_id)
        ready = [pages for until, pages in self._quarantine if until <= now]
        if ready:
            self._quarantine = [(until, pages) for until, pages in self._quarantine if until > now]
            for pages in ready:
                self._pages.release(pages)
        return expired

    @property
    def num_quarantined_pages(self) -> int:
        return sum(len(pages) for _, pages in self._quarantine)
