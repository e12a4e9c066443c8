"""A decode worker's side of the handoff, as the engine's KV connector (engine/kv_connector.py). No torch.

A reservation is a request in the engine whose pages await a prefill server's write (`RECEIVING`,
made by `Engine.reserve`). This connector gives each one `ttl_s` seconds to be admitted (its Generate
confirms the load), and `poll` names those past it, which the engine then drops. The pages of a
reservation dropped unadmitted may still be the target of a write in flight, so unless the caller knows
no write can still land (`write_settled`) they sit out `grace_s` seconds in quarantine before `poll`
gives them back. Pages the reservation shared from the prefix cache are never written from outside:
the engine lets those go at once.

Single-threaded: the engine thread calls it, as it calls the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.kv_connector import KVConnector, KVPoll
from engine.request import Request

logger = logging.getLogger(__name__)


class KVReceiveConnector(KVConnector):
    """Deadlines of the reservations and the quarantine of dropped ones; `clock` is time.monotonic's
    kind (seconds)."""

    takes_kv_in = True

    def __init__(self, ttl_s: float, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or grace_s < 0:
            raise ValueError("a reservation's ttl must be positive and its write grace >= 0")
        self.ttl_s = ttl_s
        self.grace_s = grace_s
        self.clock = clock
        self._deadlines: dict[str, float] = {}  # request id -> when its reservation expires
        self._quarantine: list[tuple[float, list[int]]] = []  # (reusable at, pages)

    def on_reserved(self, req: Request) -> None:
        self._deadlines[req.request_id] = self.clock() + self.ttl_s

    def keep(self, request_id: str) -> None:
        """Keep a reservation at least `ttl_s` more seconds: its Generate has arrived and is getting ready
        (compiling a grammar), so the prefill's KV is already in its pages. An unknown id is ignored."""
        if request_id in self._deadlines:
            self._deadlines[request_id] = max(self._deadlines[request_id], self.clock() + self.ttl_s)

    def on_received(self, req: Request) -> None:
        self._deadlines.pop(req.request_id, None)

    def on_dropped(self, req: Request, written_page_ids: list[int], write_settled: bool) -> bool:
        self._deadlines.pop(req.request_id, None)
        if write_settled or self.grace_s <= 0:
            return False
        self._quarantine.append((self.clock() + self.grace_s, written_page_ids))
        return True

    def poll(self) -> KVPoll:
        now = self.clock()
        expired = [request_id for request_id, deadline in self._deadlines.items() if deadline <= now]
        for request_id in expired:  # reported once: the engine drops them now
            del self._deadlines[request_id]
            logger.warning("reservation for %s expired unused; its pages are released", request_id)
        released: list[int] = []
        if self._quarantine and self._quarantine[0][0] <= now:  # in order of their ends: grace_s is one value
            while self._quarantine and self._quarantine[0][0] <= now:
                released += self._quarantine.pop(0)[1]
        return KVPoll(expired=expired, released=released)

    @property
    def num_reservations(self) -> int:
        return len(self._deadlines)

    @property
    def num_quarantined_pages(self) -> int:
        return sum(len(pages) for _, pages in self._quarantine)
