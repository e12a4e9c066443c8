"""`Worker`: one prefill or decode worker as the gateway sees it. Its `WorkerClient`, whether it is
ready (health SERVING and model info reported), its last reported load and this gateway's requests on
it now, what its KV events say its prefix cache holds, and how often its calls failed in a row (a
worker that keeps failing is skipped a while)."""

from __future__ import annotations

import logging
import time

from gateway.cluster.client import WorkerClient
from gateway.cluster.prefix_index import EventIndex
from gateway.cluster.worker_errors import WorkerError
from gateway.cluster.worker_records import ModelInfo, WorkerLoad
from gateway.records import Role
from tandem.internal_auth import InternalCredentials

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
# After this many failed calls in a row a worker is skipped for 1 s, then 2, 4, ... up to the cap;
# once the skip is over and its health probe answers SERVING, traffic tries it again (one success
# clears the count).
_FAILURES_BEFORE_SKIP = 3
_MAX_SKIP_S = 30.0


class Worker:
    """One worker as the pool sees it. `is_ready`: its health service says SERVING and it reported its
    model `info` (kept from the last probe that got one). `load`: its last GetLoad answer, taken on
    each probe while ready. `num_in_flight`: this gateway's requests on it now, counted from the
    routing decision (so a burst decided before the next probe spreads) to the end of its part of the
    trip. `num_ready_changes` counts its turns to ready, so a restart (which passes through not ready)
    is seen even between two reads. `event_index`: the pages its KV events say its prefix cache
    holds, live while the pool follows its stream (`gateway/cluster/kv_events.py`). Event loop only."""

    def __init__(
        self, role: Role | str, address: str, credentials: InternalCredentials = InternalCredentials()
    ) -> None:
        self.client = WorkerClient(role, address, credentials)
        self.is_ready = False
        self.info: ModelInfo | None = None
        self.load: WorkerLoad | None = None
        self.num_in_flight = 0
        self.num_ready_changes = 0
        self.event_index = EventIndex()
        self._in_flight_at_load = 0  # num_in_flight when `load` was taken
        self._num_failures = 0  # calls failed in a row
        self._skip_until = 0.0  # time.monotonic()

    @property
    def role(self) -> Role:
        return self.client.role

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def weights_id(self) -> str | None:
        return self.info.weights_id if self.info is not None else None

    @property
    def is_routable(self) -> bool:
        """Ready, and not skipped for failing calls."""
        return self.is_ready and time.monotonic() >= self._skip_until

    @property
    def queue_load(self) -> int:
        """Requests on this worker now: this gateway's (exact) plus, from its last report, those of
        others (other gateways, or reservations this gateway no longer tracks)."""
        if self.load is None:
            return self.num_in_flight
        reported = self.load.num_running + self.load.num_waiting
        return self.num_in_flight + max(0, reported - self._in_flight_at_load)

    @property
    def num_free_pages(self) -> int:
        """Pages free or kept only by the prefix cache, at its last report (0 before any)."""
        return 0 if self.load is None else self.load.num_free_pages + self.load.num_cached_pages

    async def probe(self) -> bool:
        """Ask the worker's health service, then its model info (a restarted worker may come back with
        another context length or pool, and an update changes its weights), then its load."""
        info = await self.client.model_info(PROBE_TIMEOUT_S)
        if info is not None:
            if info != self.info:  # the same object while unchanged: the pool's pairing checks are cached by it
                self.info = info
            in_flight = self.num_in_flight  # before the await: requests routed meanwhile are not in the report
            try:
                self.load, self._in_flight_at_load = await self.client.load(PROBE_TIMEOUT_S), in_flight
            except WorkerError:
                self.load = None  # routing goes by this gateway's own counts until it answers again
        self._set_ready(info is not None)
        return self.is_ready

    async def responds(self) -> bool:
        """Whether the worker answers a health check now; one that does not is marked unready until
        the next probe round finds it answering again."""
        if await self.client.responds(PROBE_TIMEOUT_S):
            return True
        if self.is_ready:
            logger.warning("%s worker %s stopped responding; it gets no new requests", self.role, self.address)
        self._set_ready(False)
        return False

    def record_failure(self, error: WorkerError) -> None:
        """A call failed because of the worker (unreachable, refused, reset, draining, stalled): it gets
        no new request until a probe finds it serving again, and after several failures in a row it is
        skipped for a while even then. Only a failure while it was taken for ready counts: the calls in
        flight when it went down fail together, one incident (a crash and a restart must not keep a
        worker that serves again out of the routing), and a worker that fails again each time a probe
        brings it back is the one to skip."""
        if not self.is_ready:
            return
        self._num_failures += 1
        if self._num_failures >= _FAILURES_BEFORE_SKIP:
            skip_s = min(_MAX_SKIP_S, 2.0 ** (self._num_failures - _FAILURES_BEFORE_SKIP))
            self._skip_until = time.monotonic() + skip_s
            logger.warning(
                "%s worker %s failed %d calls in a row (last: %s); skipped for %g s",
                self.role,
                self.address,
                self._num_failures,
                error.detail,
                skip_s,
            )
        self._set_ready(False)

    def record_success(self) -> None:
        self._num_failures = 0

    def _set_ready(self, ready: bool) -> None:
        if ready != self.is_ready:
            logger.info("%s worker %s is %s", self.role, self.address, "ready" if ready else "not ready")
            self.num_ready_changes += ready
        self.is_ready = ready
